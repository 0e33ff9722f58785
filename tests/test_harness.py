"""The test harness's own instruments, where a wrong reading would make other tests pass or fail by chance."""

from __future__ import annotations

import socket

from ._drivers import ClientSockets


def test_client_sockets_count_only_those_connected_after_the_view_was_made() -> None:
    # A socket connected before the view stands for one an earlier test left to the garbage collector, connected to
    # an earlier server that had the same port number.
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as earlier:
            view = ClientSockets(port)
            assert view.count() == 0, view.describe()
            with socket.create_connection(("127.0.0.1", port)) as later:
                assert view.count() == 1
                assert f"from port {later.getsockname()[1]} ESTABLISHED" in view.describe()
                assert f"from port {earlier.getsockname()[1]}" not in view.describe()
            assert view.count() == 0, view.describe()
