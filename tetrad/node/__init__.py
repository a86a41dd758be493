"""The node launcher: what runs in every pod of a job (and every node of `tetrad run`) around torchrun.

`python3 tetrad-node.pyz supervise -- torchrun ...` is a pod's command; torchrun starts each worker as
`tetrad-node.pyz worker ENTRY -- ARGS`, which runs the preflight gang check, then the entry point (Tetrad's
trainer, or the user's script, module or command) in the same process, and reports how it ended. The
supervisor turns what its workers reported into the node's exit code and the pod's termination message
(tetrad.api.termination). docs/bring-your-own.md has the contract; docs/architecture.md the layers.

The renderer ships these modules to every pod as a zip in the job's ConfigMap (tetrad.node.bundle), so
a pod needs only `python3` and torch, not Tetrad: every module here imports the standard library and
tetrad.api's standard-library modules only, and torch inside the functions that need it
(tests/api/test_node.py checks both, and runs the zip with `python3 -I -S`).
"""
