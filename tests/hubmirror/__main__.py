"""``python tests/hubmirror FOLDER [PORT]``: serve a folder of stand-ins (``standins.py``) until interrupted, for
trying commands by hand with ``HF_ENDPOINT`` set to the address it prints."""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from hubmirror.server import HubMirror  # noqa: E402

if len(sys.argv) not in (2, 3):
    sys.exit("usage: python tests/hubmirror FOLDER [PORT]")
hub = HubMirror(Path(sys.argv[1]), port=int(sys.argv[2]) if len(sys.argv) == 3 else 0).start()
print(f"HF_ENDPOINT={hub.endpoint}", flush=True)
try:
    while True:
        time.sleep(3600)
except KeyboardInterrupt:
    hub.stop()
