"""Where and when a benchmark ran: recorded next to every result."""

import datetime
import os
import platform
import subprocess

import torch


def cpu_model():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def describe(command):
    return {
        "command": command,
        "machine": f"{cpu_model()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}",
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
