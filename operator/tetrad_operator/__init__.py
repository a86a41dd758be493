"""The Tetrad operator: runs ParallelTrainingJobs as gang-scheduled pods (kopf; no torch)."""
