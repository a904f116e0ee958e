"""llmgw-slurm: an OpenAI-compatible LLM gateway whose replicas are Slurm jobs.

The package is folders in layers; each folder's ``__init__`` says what lives
there and what it may import, and ``scripts/check-structure`` holds every
import to that (docs/architecture.md draws the tree, lowest layer first).
Beside the folders stand a few modules that everything is built on or
around: the catalog (``models.yaml``), the job scripts, the configuration
(``server.yaml``, ``agent.yaml``) and the daemon that wires it all together.

Modules: catalog, sbatch, config, daemon.
"""

from llmgw_slurm.base.errors import ConfigError, LlmgwError, SlurmError

__version__ = "0.1.0"
__all__ = ["ConfigError", "LlmgwError", "SlurmError", "__version__"]
