"""tunnel: servers that edge agents dial out to, and the agents themselves."""
