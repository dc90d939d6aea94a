import sys
from pathlib import Path

# Shared test helpers (fake_upstreams) are imported by module name, whatever pytest's import mode.
sys.path.insert(0, str(Path(__file__).parent))
