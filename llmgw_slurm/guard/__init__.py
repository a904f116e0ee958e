"""What keeps the daemon alive under load and faults.

- :mod:`~llmgw_slurm.guard.fds`: the open-files limit raised at start and
  shared out (a reserve for Slurm commands and state files, a bound per
  listener);
- :mod:`~llmgw_slurm.guard.limiter`, :mod:`~llmgw_slurm.guard.peers` and
  :mod:`~llmgw_slurm.guard.accept`: connections bounded in total and per
  peer (a local user's uid, a remote address), and closed when no request
  head comes in time; independent of the HTTP server that serves them;
- :mod:`~llmgw_slurm.guard.faults`: unexpected exceptions logged, counted
  and survived; :mod:`~llmgw_slurm.guard.metrics` shows both in ``/metrics``;
- :mod:`~llmgw_slurm.guard.heap`: the heap a burst of connections left
  resident, given back to the kernel.

May import: nothing (the standard library and prometheus_client only).
"""

from llmgw_slurm.guard.accept import Acceptor, Guard, bind_listeners, guard_of, hand_over
from llmgw_slurm.guard.faults import Faults
from llmgw_slurm.guard.fds import FdBudget, open_fds, raise_open_files_limit
from llmgw_slurm.guard.limiter import ConnectionLimiter, Seat
from llmgw_slurm.guard.peers import CLOSED_PEER, PeerIdentifier, peer_of

__all__ = [
    "CLOSED_PEER",
    "Acceptor",
    "ConnectionLimiter",
    "Faults",
    "FdBudget",
    "Guard",
    "PeerIdentifier",
    "Seat",
    "bind_listeners",
    "guard_of",
    "hand_over",
    "open_fds",
    "peer_of",
    "raise_open_files_limit",
]
