"""Makes the installed torch look like the supported floor (torch 2.6) to every process that starts with
this folder on PYTHONPATH: the parent, torchrun's agent and the workers. tests/test_torch_floor.py runs
real jobs this way, so the launcher's fallbacks (launcher/compat.py) are exercised on every CI run.

What 2.6 lacks, hidden here as 2.6 lacks it (giving the argument fails the same way):
- torchrun --signals-to-handle (2.10) and --shutdown-timeout (2.12): the flags are renamed out of reach,
  their defaults stay (what the agent then does is what 2.6's does: relay SIGTERM/INT/HUP/QUIT, wait 30 s);
- DDP(forward_sync_buffers=...) (2.13): a TypeError, and gone from the signature.
"""
import inspect

from torch.distributed import run as torchrun
from torch.nn.parallel import DistributedDataParallel

HIDDEN_FLAGS = ("--signals-to-handle", "--shutdown-timeout")
_get_args_parser = torchrun.get_args_parser


def get_args_parser():
    parser = _get_args_parser()
    for action in parser._actions:
        if set(action.option_strings) & set(HIDDEN_FLAGS):
            for flag in action.option_strings:
                del parser._option_string_actions[flag]
            # still an option (not a positional), with its default, but no command line can reach it
            action.option_strings = ["--torch-floor-hid" + action.option_strings[0][1:]]
            parser._option_string_actions[action.option_strings[0]] = action
    return parser


_ddp_init = DistributedDataParallel.__init__


def ddp_init(self, module, *args, **kwargs):
    if "forward_sync_buffers" in kwargs:
        raise TypeError("DistributedDataParallel.__init__() got an unexpected keyword argument "
                        "'forward_sync_buffers'")
    _ddp_init(self, module, *args, **kwargs)


_signature = inspect.signature(_ddp_init)
ddp_init.__signature__ = _signature.replace(
    parameters=[p for p in _signature.parameters.values() if p.name != "forward_sync_buffers"])
torchrun.get_args_parser = get_args_parser
DistributedDataParallel.__init__ = ddp_init
