"""The pure renderer: job -> Service, ConfigMap, Pods and gang objects."""

from tetrad.render.env import torchrun_env
from tetrad.render.objects import Rendered, render

__all__ = ["Rendered", "render", "torchrun_env"]
