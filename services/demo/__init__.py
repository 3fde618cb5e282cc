"""Demo pieces `waygate up` runs beside the services (not part of any service)."""
