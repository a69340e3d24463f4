"""Several world scripts in one world (tests/harness.py SHARED_WORLDS): each script given as an
argument is run as ``__main__`` while its ``world_main(checks)`` only hands the checks over; then
every check runs here, in the order given, its result named "<script>::<check>"."""

import runpy
import sys

from tests import harness


def main(scripts) -> None:
    checks = []
    for script in scripts:
        harness._collect = []
        runpy.run_path(str(harness.REPO / "tests" / script), run_name="__main__")
        checks += [(f"{script}{harness._SEP}{name}", fn) for found in harness._collect for name, fn in found]
    harness._collect = None
    sys.argv = sys.argv[:1]  # the scripts' checks see no arguments, as when each runs alone
    harness.world_main(checks)


if __name__ == "__main__":
    main(sys.argv[1:])
