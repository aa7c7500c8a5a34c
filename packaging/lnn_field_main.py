# The frozen app's entry point: the same main() as the lnn-field console script.
import sys

from lnn.tools.field import main

if __name__ == "__main__":
    sys.exit(main())
