import os
import sys

# The seed's examples are plain modules next to the tests.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
