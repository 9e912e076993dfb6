import sys

from distpool.cli import main

sys.exit(main())
