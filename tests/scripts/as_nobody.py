"""Runs the rest of the command line (python's arguments) as uid/gid 65534, as a job that does not run as root would.

Must start as root. The interpreter's directories under private ones (a virtual environment under /root, mode 0700)
are made reachable the way the sandbox does it (:func:`hfllamarl.sandbox.jail.reveal_interpreter`: in a mount
namespace of this process, the private directory covered by a tmpfs holding bind mounts of those directories only),
then the user is dropped and python is executed again with the arguments.
"""

import os
import sys

from hfllamarl.sandbox import jail

if os.geteuid() != 0:
    sys.exit("as_nobody.py must start as root")
hidden = jail.hidden_paths([*sys.path, sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                            os.getcwd()])
if hidden:
    jail.reveal_interpreter(hidden, None)
jail._drop_user(None)  # (the sandbox's own drop: no supplementary groups, uid and gid 65534)
os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
