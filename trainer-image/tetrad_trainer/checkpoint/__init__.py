"""Checkpoints that survive anything: DCP save and resume with an atomic commit.

What `checkpoint.path` holds (one job per path):

    latest                  "step-00000040": the newest committed checkpoint. Replacing this file
                            (tmp file, fsync, os.replace, fsync of the directory) IS the commit.
    step-00000040/
        .metadata           DCP metadata, written by rank 0
        __R_0.distcp        DCP data of rank R: its shards of the model and optimizer, as they live
        rank-0000R.pt       rank R's own state: step, RNG, data loader position
        MANIFEST.json       step, layout, resolved config, every rank's coordinates, and the size
                            and CRC32 of every file above. Written last; verified before loading.
    .tmp-step-00000050/     a save in progress, or one killed mid-way; never loaded, removed by the
                            next save
    .trash-*/               a checkpoint being deleted by retention, or a leftover of one

A checkpoint is committed when `latest` names it or a newer committed one; retention keeps the
newest `keep_last` committed checkpoints and deletes older ones only after a newer one is
committed. Each manifest names the job that wrote it (its config's jobName): a job resumes another
job's checkpoint only with checkpoint.allowForeign, and never deletes or replaces one. On resume the
`latest` checkpoint is verified against its manifest by all ranks (each
checks a share of the files); a damaged one is refused with the reason and the next older
committed checkpoint is tried.

The package in three rooms:
    store.py         the file protocol: durable writes, checksummed manifests, the atomic
                     `latest`, retention. No torch.distributed.
    state.py         what one rank saves and loads: model and optimizer through the distributed
                     state-dict API (any layout loads into any other), step, RNG, data position.
    checkpointer.py  the collective save (sync or async) and resume that compose them.
"""

from tetrad_trainer.checkpoint.checkpointer import Checkpointer, Resumed, SaveStats
from tetrad_trainer.checkpoint.state import ResumableLoader, merged_view
from tetrad_trainer.checkpoint.store import (
    CheckpointError,
    CheckpointMismatch,
    ForeignCheckpoint,
    NoGoodCheckpoint,
)

__all__ = ["CheckpointError", "CheckpointMismatch", "Checkpointer", "ForeignCheckpoint", "NoGoodCheckpoint",
           "ResumableLoader", "Resumed", "SaveStats", "merged_view"]
