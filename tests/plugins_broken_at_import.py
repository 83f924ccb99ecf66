"""A user's plug-in module with a bug that raises at import (not an ImportError): naming anything in
it from `reward.fn` or `rollout.tools` must fail at config load, naming the key."""

raise RuntimeError("the plug-in's own bug, at import")
