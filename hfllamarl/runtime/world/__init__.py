"""The process world: worlds and bridges (topology), heartbeats and failure verdicts (liveness), generator
children of a single-process job (spawn), cores lent between processes (core_lending), the garbage collector
paused during heavy imports (collector). The bottom layer: it imports nothing else of the runtime."""
