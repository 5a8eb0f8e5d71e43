import sys

from diffalign.cli import main

sys.exit(main())
