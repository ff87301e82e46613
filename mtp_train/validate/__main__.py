"""`python -m mtp_train.validate`: the validation stage (`entry.main`), its `--help` answered first."""

from __future__ import annotations

# ruff: noqa: E402  (the imports below come after `--help` is answered)
from pathlib import Path

from mtp_train.cli import answer_help_first

# before torch & co.: they take seconds to import. The package's folder names the app `validate`.
answer_help_first(__name__, str(Path(__file__).parent))

from mtp_train.validate.entry import main

if __name__ == "__main__":
    main()
