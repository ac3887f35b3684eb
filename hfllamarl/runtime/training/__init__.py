"""The trainer side: the executor that scores and trains (trainer), micro-batch packing (batching), dynamic
sampling, several passes per batch (iterations), the non-finite guard (finite), metric reductions over the
trainer ranks (rank_metrics), MoE's balancing loss (moe), logging (reporting), and the fault-tolerant replica
groups' per-step quorum and row split (replica_quorum, replica_rows; not used by the trainer yet). Imports the
layers below it, never `generation`."""
