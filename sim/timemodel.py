"""The device/network time model lives in the core (``fedswarm.timemodel``) because
clients, the server and the dashboard all need device classes; the simulator uses it
from here too."""

from fedswarm.timemodel import *  # noqa: F401,F403
from fedswarm.timemodel import __all__  # noqa: F401
