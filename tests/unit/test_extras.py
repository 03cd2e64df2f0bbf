"""The optional parts stay optional: without the extras, training needs none of them, and a command that
does need one names the extra to install."""

from __future__ import annotations

import subprocess
import sys

BLOCKER = """
import importlib.abc, sys
class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.partition(".")[0] in {"transformers", "tokenizers", "safetensors", "datasets",
                                      "prometheus_client", "tensorboard", "matplotlib"}:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Missing())
"""


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCKER + code], capture_output=True, text=True, timeout=120)


def test_the_byte_corpus_and_every_role_load_without_the_extras() -> None:
    done = _run("import swarm.cli.main, swarm.ops.run, swarm.server.lifecycle, swarm.trainer.trainer\n"
                "from swarm.config import load_config\nfrom swarm.data import load_samples\n"
                "cfg = load_config(overrides=['data.max_bytes=100000'])\n"
                "print(len(load_samples(cfg.data, cfg.model)))")
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) > 0


def test_a_command_that_needs_an_extra_names_it(tmp_path) -> None:
    done = _run(f"import sys\nfrom swarm.cli.main import run\nsys.argv = ['swarm', 'export', '{tmp_path}', "
                f"'--out', '{tmp_path / 'out'}']\nsys.exit(run())")
    assert done.returncode == 2
    assert "pip install 'swarm-parallel[hf]'" in done.stderr
