"""`python -m tools.bench SECTION [options]` from the checkout's root (tools/bench/__init__.py)."""

from tools.bench import main

raise SystemExit(main())
