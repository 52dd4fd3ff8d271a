"""Stand-in for the parts of nose DALI's older test files import (``nose.tools``)."""
