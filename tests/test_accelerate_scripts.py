"""accelerate's own distributed test script, ``accelerate/test_utils/scripts/test_ops.py``, run
against the kit under ``axolotl-dist``: the installed accelerate's file is read at test time
and only its imports are rewritten (a name the kit has comes from ``axolotl_dist``; a name it
lacks, such as ``assert_exception``, stays accelerate's). The test bodies are accelerate's,
never copied into this repository (docs/porting.md)."""

import ast
import importlib.util
from pathlib import Path
from typing import List

import pytest

import axolotl_dist as ad
from fixtures import launch_script

pytest.importorskip("accelerate")

#: The script, as shipped with accelerate.
SCRIPT = "accelerate.test_utils.scripts.test_ops"
#: What each of its test functions prints before it runs (``state.print``, main process).
STEPS = ["testing gather", "testing gather_object", "testing gather non-contiguous",
         "testing broadcast", "testing pad_across_processes", "testing reduce_sum",
         "testing reduce_mean", "testing reduce_max", "testing op_checker",
         "testing sending tensors across devices"]


def kit_imports(source: str) -> str:
    """``source`` with each ``from accelerate... import a, b`` statement split: the names
    ``axolotl_dist`` has come from it, the others from accelerate's module as before. Every
    other line is left as it is."""
    lines = source.splitlines(keepends=True)
    tree = ast.parse(source)
    edits = []
    for node in tree.body:
        if not (isinstance(node, ast.ImportFrom) and node.module
                and node.module.split(".")[0] == "accelerate"):
            continue
        ours = [a for a in node.names if hasattr(ad, a.name)]
        theirs = [a for a in node.names if not hasattr(ad, a.name)]
        text = []
        if ours:
            text.append("from axolotl_dist import " + ", ".join(_alias(a) for a in ours) + "\n")
        if theirs:
            text.append(f"from {node.module} import " + ", ".join(_alias(a) for a in theirs)
                        + "\n")
        edits.append((node.lineno - 1, node.end_lineno or node.lineno, "".join(text)))
    for start, end, text in reversed(edits):
        lines[start:end] = [text]
    return "".join(lines)


def _alias(a: ast.alias) -> str:
    return a.name if a.asname is None else f"{a.name} as {a.asname}"


def _accelerates_script() -> str:
    spec = importlib.util.find_spec(SCRIPT)
    assert spec is not None and spec.origin, f"{SCRIPT} is not in the installed accelerate"
    return Path(spec.origin).read_text()


def test_only_the_imports_are_rewritten():
    source = _accelerates_script()
    ported = kit_imports(source)
    imports = [ln for ln in ported.splitlines() if ln.startswith(("from ", "import "))]
    assert "from axolotl_dist import PartialState" in imports
    kit = next(ln for ln in imports if "DistributedOperationException" in ln)
    for name in ("broadcast", "copy_tensor_to_devices", "gather", "gather_object",
                 "pad_across_processes", "reduce"):
        assert name in kit, kit
    assert "from axolotl_dist import DistributedType" in imports
    # accelerate's test helper has no kit twin: it stays accelerate's
    assert "from accelerate.test_utils.testing import assert_exception" in imports
    # every line that is not an import is accelerate's own, in its order
    assert _outside_imports(ported) == _outside_imports(source)


def _outside_imports(source: str) -> List[str]:
    """The lines of ``source`` that no top-level import statement spans."""
    spans = [range(n.lineno - 1, n.end_lineno or n.lineno) for n in ast.parse(source).body
             if isinstance(n, (ast.Import, ast.ImportFrom))]
    return [ln for i, ln in enumerate(source.splitlines()) if not any(i in s for s in spans)]


@pytest.mark.parametrize("ranks", [2, 3])
def test_accelerates_test_ops_passes_against_the_kit(tmp_path, ranks):
    code, out, err = launch_script(tmp_path, "test_ops.py", kit_imports(_accelerates_script()),
                                   ranks, timeout=120)
    assert code == 0, f"exit {code}\n{out}\n{err[-4000:]}"
    text = out + err
    for step in STEPS:
        assert step in text, (step, text[-3000:])
    assert "State: PartialState(distributed_type=MULTI_CPU, " in text  # the script's first line
    assert "Traceback" not in text, text[-3000:]
