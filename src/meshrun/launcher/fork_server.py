"""What the server that meshrun's workers are forked from imports (meshrun.launcher.forked): it
ends with torchrun's agent that started it (the kernel's signal, meshrun.launcher.lifetime), and
every worker forked from it follows it the same way. Without this the server would outlive a
killed agent: each forked worker holds the server's pipe from the agent open. The server imports
this first, then the modules every worker imports (forked.PRELOAD)."""

import signal

from meshrun.launcher.lifetime import die_with_parent

die_with_parent(signal.SIGKILL)  # and exports this server's pid as its workers' parent
