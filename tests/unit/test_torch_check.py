"""The pre-flight's torch import is remembered on the node, and only where it can be trusted.

Each check runs in a fresh interpreter: whether it imported torch is whether ``torch`` ended up
in its ``sys.modules``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from slurmft.train import torch_check

PROBE = """
import json, sys
from pathlib import Path
from slurmft.train import torch_check
problem = torch_check.check(Path(sys.argv[1]))
print(json.dumps({"problem": problem, "imported": "torch" in sys.modules}))
"""


def probe(stamp_dir, env=None) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, str(stamp_dir)], capture_output=True,
                         text=True, timeout=300, env=env, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def stamps(stamp_dir):
    return sorted(p.name for p in stamp_dir.glob("torch-ok-*"))


def test_a_second_check_on_the_node_does_not_import_torch_again(tmp_path):
    folder = tmp_path / "stamps"
    assert probe(folder) == {"problem": None, "imported": True}
    assert len(stamps(folder)) == 1 and (os.stat(folder).st_mode & 0o777) == 0o700
    assert probe(folder) == {"problem": None, "imported": False}


def test_a_stale_stamp_or_another_install_imports_again(tmp_path):
    folder = tmp_path / "stamps"
    probe(folder)
    [name] = stamps(folder)
    old = time.time() - torch_check.TTL_S - 60
    os.utime(folder / name, (old, old))
    assert probe(folder)["imported"] is True
    # Another install (here: another torch __init__.py mtime) names another stamp.
    assert torch_check.install_key() == name.removeprefix("torch-ok-")
    (folder / name).rename(folder / "torch-ok-0000")
    assert probe(folder)["imported"] is True


def test_an_untrusted_stamp_directory_is_never_believed(tmp_path):
    folder = tmp_path / "stamps"
    probe(folder)
    os.chmod(folder, 0o777)  # writable by others: anyone could have planted the stamp
    assert probe(folder) == {"problem": None, "imported": True}
    os.chmod(folder, 0o700)
    link = tmp_path / "link"
    link.symlink_to(folder)
    assert probe(link) == {"problem": None, "imported": True}
    assert not list(tmp_path.glob("link/.torch-ok.*"))


def test_a_broken_torch_is_a_problem_and_forgets_the_stamp(tmp_path):
    folder = tmp_path / "stamps"
    probe(folder)
    broken = tmp_path / "broken"
    (broken / "torch" / "lib").mkdir(parents=True)
    (broken / "torch" / "__init__.py").write_text("raise OSError('libtorch_cpu.so: bad ELF header')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(broken), os.environ.get("PYTHONPATH", "")]))
    result = probe(folder, env)
    assert result["problem"] == "cannot import torch: OSError: libtorch_cpu.so: bad ELF header"
    assert len(stamps(folder)) == 1  # the good install's stamp; the broken one left none
    assert probe(folder)["imported"] is False
