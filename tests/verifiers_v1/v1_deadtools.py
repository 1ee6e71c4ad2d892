"""v1_tools' task, but its tool server fails: this module, run with `python -m` as verifiers serves a toolset, reports
a port as a server does and then answers every request there with an error, after writing two lines to its log."""

import os
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer

import verifiers.v1 as vf
from v1_tools import CalcTools, SumTask, SumTaskConfig, SumTasksetConfig


class DeadTools(CalcTools):
    pass


class DeadSumTask(SumTask):
    @classmethod
    def toolsets(cls, config: SumTaskConfig) -> list[vf.Toolset]:
        return [DeadTools(config.calc)]


class DeadSumTaskset(vf.Taskset[DeadSumTask, SumTasksetConfig]):
    def load(self):
        return iter(())


class Refuse(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_error(500, "this tool server is broken")

    do_POST = do_DELETE = do_GET


__all__ = ["DeadSumTaskset"]

if __name__ == "__main__":
    server = HTTPServer(("127.0.0.1", 0), Refuse)
    with open(os.environ["MCP_PORT_FILE"], "w") as port_file:
        port_file.write(str(server.server_port))
    print("starting the tools\nthis tool server is broken", file=sys.stderr, flush=True)
    server.serve_forever()
