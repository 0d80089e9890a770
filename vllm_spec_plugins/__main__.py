import sys

from vllm_spec_plugins.cli import main

sys.exit(main())
