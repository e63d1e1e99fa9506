import sys

from moegraph.cli import main

sys.exit(main())
