"""``python -m fedml_fedmitr --cf CONFIG``: see :mod:`fedml_fedmitr.cli`."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
