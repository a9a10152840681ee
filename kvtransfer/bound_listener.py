"""A UCX listener bound to one address.

ucxx 0.52's `create_listener(callback, port)` binds every interface: its Cython layer builds the
listener with a port only, though libucxx's own `ListenerBuilder` takes a host (passed to
getaddrinfo, then to `ucp_listener_create`'s sockaddr). A prefill worker bound to loopback then
still answered UCX on the network, where 2 KiB of junk on its port leaves libucx's async thread
spinning (a tcp_sockcm bug). So, where the ABI is the one checked here (ucxx 0.52, x86-64 Linux,
CPython), the listener is built through libucxx's exported C++ API with ctypes:

    Worker::listenerBuilder(port, callback, arg) -> ListenerBuilder   (sret: x86-64 SysV)
    ListenerBuilder::host(std::string)                                (a short SSO string)
    ListenerBuilder::build() -> shared_ptr<Listener>                  (sret)

and the shared_ptr is moved into a `UCXListener` made with `__new__`, whose field offsets are
checked on a throwaway instance first. Connection requests reach a ctypes callback that does
what ucxx's own `_listener_callback` does. Anything unexpected (another ucxx, another
platform, a host that is not a short address) falls back to ucxx's own listener on every
interface, with a warning. A C++ exception cannot cross ctypes (it would abort the process), so
the address and port are first checked by binding them from Python, as UCX will.

A listener on loopback also keeps UCX's own TCP data ports on loopback (NET_DEVICES=lo, unless
UCX_NET_DEVICES is set), which UCX otherwise opens on every network interface.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import socket
import sys
import weakref

log = logging.getLogger("splitserve.kvtransfer")

WILDCARDS = frozenset({"", "0.0.0.0", "::", "[::]"})
_ABI_VERSIONS = ("0.52.",)  # ucxx versions whose libucxx ABI this module was checked against
_SYMBOLS = {
    "builder": "_ZN4ucxx6Worker15listenerBuilderEtPFvP16ucp_conn_requestPvES3_",
    "host": "_ZN4ucxx15ListenerBuilder4hostENSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE",
    "build": "_ZN4ucxx15ListenerBuilder5buildEv",
    "destroy": "_ZN4ucxx15ListenerBuilderD1Ev",
}
_SP_OFFSET, _FUTURE_OFFSET = 24, 40  # UCXListener: PyObject head, vtable, then its cdef fields
_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)
_KEPT: list = []  # callbacks UCX may still call: alive for the process


class _StdString(ctypes.Structure):  # libstdc++'s std::string (cxx11 ABI), short-string form
    _fields_ = [("ptr", ctypes.c_void_p), ("size", ctypes.c_size_t), ("local", ctypes.c_char * 16)]


def bind_address(host: str) -> str:
    """The address a listener on `host` binds: getaddrinfo's first answer, as libucxx's own."""
    info = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    return info[0][4][0]


def check_bindable(addr: str, port: int) -> None:
    """Raises OSError where UCX's bind of addr:port would fail (same SO_REUSEADDR setting)."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        reuse = os.environ.get("UCX_TCP_CM_REUSEADDR", "n").lower() in ("y", "yes", "1", "on")
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, int(reuse))
        s.bind((addr, port))


def _library():
    """libucxx's C++ entry points, or the reason they cannot be used here."""
    import ucxx

    if not ucxx.__version__.startswith(_ABI_VERSIONS):
        return f"ucxx {ucxx.__version__} is not one whose ABI was checked"
    if platform.machine() != "x86_64" or sys.platform != "linux":
        return f"{sys.platform}/{platform.machine()} is not x86-64 Linux"
    if sys.implementation.name != "cpython":
        return "not CPython"
    with open("/proc/self/maps") as maps:
        paths = [ln.split()[-1] for ln in maps if ln.rstrip().endswith("/libucxx.so")]
    if not paths:
        return "libucxx.so is not loaded"
    lib = ctypes.CDLL(paths[0], mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    try:
        fns = {k: getattr(lib, name) for k, name in _SYMBOLS.items()}
    except AttributeError as exc:
        return f"libucxx lacks {exc}"
    p = ctypes.c_void_p
    fns["builder"].argtypes = [p, p, ctypes.c_uint16, p, p]
    fns["host"].argtypes = fns["build"].argtypes = [p, p]
    fns["destroy"].argtypes = [p]
    for f in fns.values():
        f.restype = p
    return fns


def _layout_ok(cls) -> bool:
    """UCXListener's fields where this module writes them: checked on a throwaway instance."""
    if (cls.__basicsize__, cls.__weakrefoffset__) != (64, 56):
        return False
    probe = cls.__new__(cls)
    base = id(probe)
    fields = (ctypes.c_void_p * 2).from_address(base + _SP_OFFSET)
    flag = ctypes.c_int.from_address(base + _FUTURE_OFFSET)
    if fields[0] or fields[1] or flag.value:
        return False
    fields[0] = 0x1000  # a pointer without a control block: resetting it frees nothing
    flag.value = 1
    ok = probe.ucxx_ptr == 0x1000 and probe.enable_python_future is True
    fields[0], flag.value = 0, 0
    return ok


_FNS = None


def _entry_points():
    global _FNS
    if _FNS is None:
        import ucxx._lib.libucxx as ucx_api

        try:
            fns = _library()
        except OSError as exc:
            fns = f"libucxx: {exc}"
        if not isinstance(fns, str) and not _layout_ok(ucx_api.UCXListener):
            fns = "ucxx's UCXListener layout differs"
        _FNS = fns
    return _FNS


def create_listener(callback, port: int, host: str | None):
    """A ucxx Listener calling `callback(endpoint)` per connection, on host:port (every
    interface when `host` is None or a wildcard, or where binding is unsupported: logged)."""
    import ucxx

    if host is None or host.strip("[]") in WILDCARDS:
        return ucxx.create_listener(callback, port)
    addr = bind_address(host.strip("[]"))
    check_bindable(addr, port)
    _loopback_devices(addr)
    fns = _entry_points()
    if isinstance(fns, str) or len(addr.encode()) > 15:
        why = fns if isinstance(fns, str) else f"address {addr} is too long"
        log.warning(
            "the UCX KV listener binds every interface, not %s (%s): keep port %d behind a "
            "firewall",
            addr,
            why,
            port,
        )
        return ucxx.create_listener(callback, port)
    return _bound(fns, callback, port, addr)


def _loopback_devices(addr: str) -> None:
    """A listener on loopback: UCX's own TCP data ports (one per network device, on every NIC
    by default) go on loopback too, where the user did not pick devices and UCX has not started
    (it reads its settings once). Given to UCX's context, not the environment, which child
    processes would inherit; shared memory and cuda_ipc are no network devices."""
    import ipaddress

    import ucxx

    if not ipaddress.ip_address(addr).is_loopback or "UCX_NET_DEVICES" in os.environ:
        return
    if getattr(ucxx.core, "_ctx", True) is None:
        ucxx.init(options={"NET_DEVICES": "lo"})
        log.info("UCX NET_DEVICES=lo: the KV listener is on loopback, so is UCX's TCP")


def _bound(fns, callback, port: int, addr: str):
    import asyncio

    import ucxx
    import ucxx._lib.libucxx as ucx_api
    from ucxx._lib_async.listener import Listener, _listener_handler, _ListenerHandlerTracker

    ctx = ucxx.core._get_ctx()
    ctx.continuous_ucx_progress()
    loop = asyncio.get_running_loop()
    tracker = _ListenerHandlerTracker()
    listener = ucx_api.UCXListener.__new__(ucx_api.UCXListener)
    ref, ctx_ref = weakref.ref(listener), weakref.ref(ctx)

    def on_connect(conn_request, _arg) -> None:  # ucxx's progress thread, as _listener_callback
        try:
            owner = ref()
            if owner is not None:
                ep = owner.create_endpoint_from_conn_request(conn_request, True)
                _listener_handler(ep, loop, callback, ctx_ref, True, ctx.connect_timeout, tracker)
        except Exception as exc:  # noqa: BLE001 - never into C
            log.error("UCX KV listener callback failed: %s", exc)

    cb = _CALLBACK(on_connect)
    _KEPT.append(cb)
    builder = (ctypes.c_char * 64)()  # a ListenerBuilder (one unique_ptr), room to spare
    fns["builder"](
        ctypes.addressof(builder), ctx.worker.ucxx_ptr, port, ctypes.cast(cb, ctypes.c_void_p), None
    )
    try:
        text = _StdString()
        text.local = addr.encode()
        text.ptr = ctypes.addressof(text) + _StdString.local.offset
        text.size = len(addr.encode())
        fns["host"](ctypes.addressof(builder), ctypes.addressof(text))  # moved from: SSO, no free
        shared = (ctypes.c_char * 16)()
        fns["build"](ctypes.addressof(shared), ctypes.addressof(builder))
    finally:
        fns["destroy"](ctypes.addressof(builder))
    ctypes.memmove(id(listener) + _SP_OFFSET, shared, 16)  # moved in: the listener owns it
    ctypes.c_int.from_address(id(listener) + _FUTURE_OFFSET).value = int(
        ctx.worker.enable_python_future
    )
    return Listener(listener, tracker, ctx)
