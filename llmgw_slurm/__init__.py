"""llmgw-slurm: an OpenAI-compatible LLM gateway whose replicas are Slurm jobs."""

from llmgw_slurm.base.errors import ConfigError, LlmgwError, SlurmError

__version__ = "0.1.0"
__all__ = ["ConfigError", "LlmgwError", "SlurmError", "__version__"]
