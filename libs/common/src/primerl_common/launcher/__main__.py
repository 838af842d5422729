import sys

from primerl_common.launcher.cli import main

sys.exit(main())
