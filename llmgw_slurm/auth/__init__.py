"""Who may do what, and how each side proves who it is.

- :mod:`~llmgw_slurm.auth.secrets`: the daemon's key and what is derived from
  it (each replica's and batch's report secret, engine keys, the admin token,
  report signatures);
- :mod:`~llmgw_slurm.auth.tls`: mutual TLS between the gateway and its
  engines (key pairs, pinning);
- :mod:`~llmgw_slurm.auth.private`: folders and files only the daemon's user
  may write;
- :mod:`~llmgw_slurm.auth.identity`: how a CLI knows it talks to the daemon,
  and who is at the other end of a local socket;
- :mod:`~llmgw_slurm.auth.munge`: the cluster's own proof of a local user;
- :mod:`~llmgw_slurm.auth.keys`: the users' gateway API keys, hashed at rest,
  and the ring the gateway checks them against;
- :mod:`~llmgw_slurm.auth.login`: ``llmgw login`` (a key for a munge-proven
  user) and a user's own keys;
- :mod:`~llmgw_slurm.auth.access`: who may use which model (the catalog's
  ``access`` rules against a key).

This package's own import loads nothing.

May import: base, slurm, catalog, config.
"""
