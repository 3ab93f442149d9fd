"""python -m tierckptd"""

import sys

from tierckptd.main import main

sys.exit(main())
