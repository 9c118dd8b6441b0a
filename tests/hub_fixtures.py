"""Fixtures around the local Hub server (tests/hub_server.py): import them into a test module with
`from hub_fixtures import *`.

huggingface_hub reads HF_ENDPOINT when it is imported, and conftest.py imports it (through turboquant_hf) before
any test runs. So the checks that matter most (push, then `from_pretrained(repo_id)` and `pipeline`) run in fresh
Python processes whose environment names the local server (`hub_env`, `run_python`); in-process tests get the
server through `hub_in_process`, which sets the environment and the constants huggingface_hub has already read.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from hub_server import LocalHub

__all__ = ["local_hub", "hub_env", "hub_in_process", "run_python", "point_at_local_hub"]


@pytest.fixture(scope="session")
def local_hub():
    hub = LocalHub().start()
    yield hub
    hub.stop()


@pytest.fixture(scope="session")
def hub_env(local_hub, tmp_path_factory):
    """Environment for a fresh process that talks to the local Hub (and caches downloads in a temp dir)."""
    env = dict(os.environ)
    env.update(
        HF_ENDPOINT=local_hub.url,
        HF_TOKEN=local_hub.token,
        HF_HUB_CACHE=str(tmp_path_factory.mktemp("hf_cache")),
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_DISABLE_XET="1",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        TOKENIZERS_PARALLELISM="false",
    )
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("TRANSFORMERS_OFFLINE", None)
    return env


def point_at_local_hub(mp: pytest.MonkeyPatch, hub: LocalHub, env: dict) -> None:
    """Make this process's huggingface_hub talk to `hub`: the environment, and the copies of the endpoint that
    huggingface_hub's modules took when they were imported (`constants.ENDPOINT`, and in some versions names
    imported from it, e.g. `repocard.ENDPOINT`)."""
    for key in ("HF_ENDPOINT", "HF_TOKEN", "HF_HUB_CACHE", "HF_HUB_DISABLE_XET"):
        mp.setenv(key, env[key])
    template = hub.url + "/{repo_id}/resolve/{revision}/{filename}"
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "huggingface_hub" or name.startswith("huggingface_hub.")):
            continue
        if isinstance(getattr(module, "ENDPOINT", None), str):
            mp.setattr(module, "ENDPOINT", hub.url)
        if isinstance(getattr(module, "HUGGINGFACE_CO_URL_TEMPLATE", None), str):
            mp.setattr(module, "HUGGINGFACE_CO_URL_TEMPLATE", template)
        if isinstance(getattr(module, "HF_HUB_CACHE", None), str):
            mp.setattr(module, "HF_HUB_CACHE", env["HF_HUB_CACHE"])
    # huggingface_hub retries 5xx answers and dropped connections with a 1 + 2 + 4 + 8 + 8 s backoff: keep the
    # retries, skip the waiting.
    from huggingface_hub.utils import _http

    mp.setattr(_http.time, "sleep", lambda s: None)


@pytest.fixture
def hub_in_process(local_hub, hub_env, monkeypatch):
    """Point this process's huggingface_hub at the local Hub for one test."""
    point_at_local_hub(monkeypatch, local_hub, hub_env)
    return local_hub


def run_python(code: str, env: dict, timeout: int = 300) -> str:
    """Run `code` in a fresh Python process; return its stdout, failing the test with its stderr otherwise."""
    # run outside the checkout: its `kernels/` folder would shadow Hugging Face's `kernels` package
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=env["HF_HUB_CACHE"])
    if proc.returncode != 0:
        pytest.fail(f"subprocess failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc.stdout
