"""Plan search: python search_plan.py --world-size 16 --ranks-per-node 8 <model flags> [--save-plan F]
(--help: its own options first, and an example)."""

import sys


def main(argv=None) -> int:
    from puzzle.plan_search.command import search_main

    return search_main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    from puzzle.parallel import launcher

    launcher.exit_process(main())
