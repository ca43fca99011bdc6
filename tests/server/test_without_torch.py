"""The serving image has no torch: the server must import, load and serve without it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import asyncio, importlib.abc, sys

class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"{name} is not installed in the serving image")
        return None

sys.meta_path.insert(0, NoTorch())
import server.app, client, server.workers  # noqa: E402
from server.config import ServerConfig  # noqa: E402

async def main():
    config = ServerConfig(host="127.0.0.1", port=0, http_port=0, metrics_port=-1, model_dir=sys.argv[1])
    srv, port = await server.app.create_server(config)
    embedder = client.AsyncEmbeddingClient(f"127.0.0.1:{port}")
    result = await embedder.embed(["served without torch"])
    await embedder.close()
    await srv.stop(1)
    print(len(result.embeddings[0]))

asyncio.run(main())
assert not [m for m in sys.modules if m == "torch" or m.startswith("torch.")]
"""


def test_server_imports_loads_and_serves_with_torch_unavailable(tiny_artifacts: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny_artifacts)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "32"


def test_dockerfile_passes_hadolint() -> None:
    import shutil

    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    done = subprocess.run([hadolint, str(ROOT / "deploy" / "Dockerfile")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
