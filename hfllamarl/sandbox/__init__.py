"""Untrusted work (model-written code, parsers fed model text) run in isolated, fresh processes, bounded in time,
memory, processes, files and network. Public for plugins: a reward or an environment that runs model output uses
`Sandbox`; `SandboxTimeout` means "unscored", never a score.

Modules: `client` (the parent side, `Sandbox`), `server` (the forked server that starts each call), `jail` (the
per-call child: limits, namespaces, the seccomp filter)."""

from hfllamarl.sandbox.client import Sandbox, SandboxBusy, SandboxError, SandboxTimeout, SandboxUnavailable

__all__ = ["Sandbox", "SandboxBusy", "SandboxError", "SandboxTimeout", "SandboxUnavailable"]
