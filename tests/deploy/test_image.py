"""The container image can be built and deployed as the README says (issue 29 finding 10).

- deploy/Containerfile: a `build` stage that makes the wheel and a `runtime` stage
  that installs it as a non-root user, both from a base image with a pinned tag;
- every image an overlay renders is either the one `make image` builds here
  (waygate/waygate:VERSION, the version in pyproject.toml) or a public image with
  a pinned version tag (never `latest` or `dev`, which nobody publishes);
- `make image` calls the first engine found with that tag, and says clearly when
  there is none (a stand-in engine script records the call: no container engine
  can run on these machines);
- the README's `images:` override, added to an overlay, renders every Waygate
  workload from the registry copy.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from tests.deploy.test_kustomize import OVERLAYS, ROOT, render

CONTAINERFILE = ROOT / "deploy" / "Containerfile"
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
BUILT_HERE = f"waygate/waygate:{VERSION}"
# A version tag (1.62.0, 3.11-slim-bookworm) or a digest: what "pinned" means here.
PINNED = re.compile(r"^[^:@\s]+(:\d+(\.\d+)+[\w.-]*|@sha256:[0-9a-f]{64})$")


def stages() -> list[tuple[str, str, list[str]]]:
    """(base image, stage name, its instructions) for each FROM of the Containerfile."""
    found: list[tuple[str, str, list[str]]] = []
    for line in CONTAINERFILE.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        words = line.split()
        if words[0].upper() == "FROM":
            assert len(words) == 4 and words[2].upper() == "AS", f"unnamed stage: {line}"
            found.append((words[1], words[3], []))
        else:
            assert found, f"an instruction before FROM: {line}"
            found[-1][2].append(line)
    return found


def test_the_containerfile_builds_a_wheel_then_a_non_root_runtime() -> None:
    (build_base, build, build_steps), (runtime_base, runtime, runtime_steps) = stages()
    assert (build, runtime) == ("build", "runtime")
    for base in (build_base, runtime_base):
        assert PINNED.match(base), f"{base}: not a pinned tag"
    assert any(step.startswith("RUN pip wheel") for step in build_steps)
    assert "COPY --from=build /wheels /wheels" in runtime_steps
    assert not any(s.startswith("COPY services") for s in runtime_steps), "sources stay in build"
    (user,) = [s for s in runtime_steps if s.startswith("USER ")]
    uid = user.split()[1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, user
    assert runtime_steps[-1] == 'ENTRYPOINT ["waygate"]'


def rendered_images(text: str) -> set[str]:
    images = set()
    for document in yaml.safe_load_all(text):
        spec = ((document or {}).get("spec") or {}).get("template", {}).get("spec") or {}
        for container in spec.get("containers", []) + spec.get("initContainers", []):
            images.add(container["image"])
    return images


@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_every_image_an_overlay_names_is_built_here_or_public_and_pinned(overlay: str) -> None:
    images = rendered_images(render(overlay))
    assert BUILT_HERE in images
    for image in images - {BUILT_HERE}:
        assert not image.startswith("waygate/"), f"{overlay}: {image} is not what make image builds"
        assert PINNED.match(image), f"{overlay}: {image} has no pinned version tag"


def make(tmp_path: Path, path: str, *args: str) -> subprocess.CompletedProcess[str]:
    maker = shutil.which("make")
    assert maker, "make is needed"
    return subprocess.run(
        [maker, "-s", "-C", str(ROOT), "image", *args],
        env={**os.environ, "PATH": path},
        capture_output=True,
        text=True,
        timeout=60,
    )


def tools_dir(tmp_path: Path) -> Path:
    """A PATH directory with the shell tools the Makefile uses and no container engine."""
    tools = tmp_path / "tools"
    tools.mkdir()
    for tool in ("sh", "sed", "head"):
        found = shutil.which(tool)
        assert found
        (tools / tool).symlink_to(found)
    return tools


def test_make_image_without_an_engine_says_what_to_install(tmp_path: Path) -> None:
    result = make(tmp_path, str(tools_dir(tmp_path)))
    assert result.returncode != 0
    assert "no container engine found: install podman, buildah or docker" in result.stderr


@pytest.mark.parametrize("engine", ["podman", "buildah", "docker"])
def test_make_image_builds_with_the_engine_found_tagged_with_the_version(
    tmp_path: Path, engine: str
) -> None:
    tools = tools_dir(tmp_path)
    record = tmp_path / "called"
    # A STAND-IN engine (none can run here): it records how it was called.
    stand_in = tools / engine
    stand_in.write_text(f'#!/bin/sh\necho "$*" > {record}\n')
    stand_in.chmod(0o755)
    result = make(tmp_path, str(tools))
    assert result.returncode == 0, result.stderr
    assert record.read_text().split() == [
        "build", "-f", "deploy/Containerfile", "-t", BUILT_HERE, ".",
    ]  # fmt: skip
    assert f"built {BUILT_HERE}" in result.stdout


def test_the_readmes_images_override_renders_the_registry_copy(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    deploying = readme.split("## Deploying", 1)[1].split("\n## ", 1)[0]
    block = deploying.split("```yaml\n", 1)[1].split("```", 1)[0]
    override = yaml.safe_load("\n".join(line.removeprefix("   ") for line in block.splitlines()))
    (image,) = override["images"]
    overlay = tmp_path / "mine"
    overlay.mkdir()
    dev = os.path.relpath(ROOT / "deploy/kustomize/overlays/dev", overlay)
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump({"resources": [dev], **override}, sort_keys=False)
    )
    kubectl = shutil.which("kubectl")
    assert kubectl
    result = subprocess.run(
        [kubectl, "kustomize", str(overlay)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    images = rendered_images(result.stdout)
    mine = f"{image['newName']}:{image['newTag']}"
    assert image["newTag"] == VERSION
    assert mine in images and not any(i.startswith("waygate/") for i in images), images
