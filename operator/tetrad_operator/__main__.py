import sys

from tetrad_operator.main import main

sys.exit(main())
