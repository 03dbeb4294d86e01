"""`invoke build push` against a real local registry, then a pull by digest and a run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import urllib.request

import pytest

from ddp_tasks import image_commands as ic
from tests.fixtures.docker import COLD_BUILD_TIMEOUT, HOST_CA_BUNDLE


@pytest.mark.docker
@pytest.mark.timeout(COLD_BUILD_TIMEOUT)
def test_build_push_pull_by_digest_and_run(cpu_image, base_image, registry, dockerd,
                                           run_in_image):
    # chained as a user types it; the build reuses the cpu_image layers (same inputs)
    command = [sys.executable, "-m", "invoke", "build", "--base-image", base_image,
               "--ca-bundle", str(HOST_CA_BUNDLE), "push"]
    env = {**os.environ, "DDP_REGISTRY": registry}
    result = subprocess.run(command, cwd=ic.ROOT, env=env, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    match = re.search(rf"^pushed ({re.escape(registry)}/ddp@sha256:[0-9a-f]{{64}})$",
                      result.stdout, re.MULTILINE)
    assert match, result.stdout[-3000:]
    reference = match.group(1)
    digest = reference.split("@")[1]

    # the registry serves that manifest by digest
    request = urllib.request.Request(
        f"http://{registry}/v2/ddp/manifests/{digest}",
        headers={"Accept": "application/vnd.docker.distribution.manifest.v2+json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.headers["Docker-Content-Digest"] == digest

    dockerd.images.remove(f"{registry}/ddp:cpu")
    pulled = dockerd.images.pull(reference)
    try:
        assert reference in pulled.attrs["RepoDigests"]
        assert pulled.id == dockerd.images.get(cpu_image).id
        status, output = run_in_image(reference, ["python", "-m", "launcher.check"])
        assert status == 0, output
    finally:
        dockerd.images.remove(reference)


def test_push_without_a_registry_says_how_to_name_one():
    env = {k: v for k, v in os.environ.items() if k != "DDP_REGISTRY"}
    result = subprocess.run([sys.executable, "-m", "invoke", "push"], cwd=ic.ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "no registry to push to" in result.stderr
    assert "HINT: pass --registry" in result.stderr
