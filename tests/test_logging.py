"""get_logger: main-process logging with a rank prefix, and the stderr fallback while logging
is unconfigured."""

import logging
import os

import axolotl_dist as ad
from axolotl_dist.testing import run_distributed

# ---------------------------------------------------------------- logging


def test_get_logger_main_only_with_rank_prefix_and_no_side_effects():
    log = ad.get_logger("axolotl_dist.tests.logger")
    assert not ad.is_initialized()

    def body():
        records = []
        handler = logging.Handler()
        handler.emit = lambda rec: records.append((rec.getMessage(), rec.filename))
        logger = logging.getLogger("axolotl_dist.tests.logger")
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        log.info("step %d", 5)
        log.warning("everywhere", main_process_only=False)
        return records

    out = run_distributed(body, 2, timeout=60)
    assert out[0] == [("[rank 0/2] step 5", "test_logging.py"), ("[rank 0/2] everywhere", "test_logging.py")]
    assert out[1] == [("[rank 1/2] everywhere", "test_logging.py")]
    assert not ad.is_initialized()


LOGGING_SCENARIOS = r'''
import logging, os, sys
import axolotl_dist as ad
log = ad.get_logger("demo")
os.environ["AXOLOTL_DIST_DEFAULT_LOGGING"] = "0"  # off: Python's rules (WARNING+, message only)
log.info("hidden-off")
log.warning("last resort")
del os.environ["AXOLOTL_DIST_DEFAULT_LOGGING"]
log.info("shown %d", 1)                          # unconfigured: INFO goes to stderr
log.debug("hidden-debug")
try:
    1 / 0
except ZeroDivisionError:
    log.exception("with traceback")
logging.getLogger("demo").setLevel(logging.WARNING)
log.info("hidden-level")                          # an explicit level is respected
logging.getLogger("demo").setLevel(logging.NOTSET)
logging.basicConfig(level=logging.WARNING, format="configured %(message)s")
log.info("hidden-configured")                     # the user's configuration takes over
log.warning("once")                               # printed once, by the user's handler
'''


def test_get_logger_shows_info_while_logging_is_unconfigured_and_yields_to_configuration():
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root)
    env.pop(ad.log.DEFAULT_LOGGING_ENV_VAR, None)
    run = subprocess.run([sys.executable, "-c", LOGGING_SCENARIOS], env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    lines = run.stderr.splitlines()
    assert lines[0] == "[rank 0/1] last resort", run.stderr
    assert lines[1].endswith(" INFO demo: [rank 0/1] shown 1"), run.stderr
    assert lines[2].endswith(" ERROR demo: [rank 0/1] with traceback")
    assert "ZeroDivisionError: division by zero" in run.stderr
    assert "hidden" not in run.stderr
    assert lines[-1] == "configured [rank 0/1] once" and run.stderr.count("once") == 1


