import sys

from primerl_launcher.cli import main

sys.exit(main())
