"""A worker target whose import takes longer than the calls' deadline (as sympy's can on a busy machine)."""

import time

time.sleep(1.5)


def echo(value):
    return value
