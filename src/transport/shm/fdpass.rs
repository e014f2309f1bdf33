//! Unix-domain sockets in the abstract namespace, and one file descriptor passed over them with
//! `SCM_RIGHTS`. An abstract name is reachable only from the same host and network namespace, so
//! the descriptor arriving is the proof that both engines share a host.

use std::io::Read;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::time::{Duration, Instant};

use crate::error::{Error, Result, Status};

/// Bytes of the nonce that ties a local connection to the control stream that announced it.
pub const NONCE_BYTES: usize = 16;

/// `n` bytes from the kernel's random source.
pub fn random_bytes(n: usize) -> Result<Vec<u8>> {
    let mut out = vec![0u8; n];
    let mut filled = 0;
    while filled < n {
        // SAFETY: the pointer and length name the unfilled tail of `out`.
        let got = unsafe { libc::getrandom(out[filled..].as_mut_ptr().cast(), n - filled, 0) };
        if got < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(Error::internal("getrandom failed").with_source(e));
        }
        filled += got as usize;
    }
    Ok(out)
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Listens on a fresh abstract name ("kvstage-shm-<pid>-<random>"); returns it with the listener.
pub fn listen_abstract() -> Result<(String, UnixListener)> {
    let name = format!("kvstage-shm-{}-{}", std::process::id(), hex(&random_bytes(12)?));
    let addr = SocketAddr::from_abstract_name(name.as_bytes()).map_err(|e| Error::internal("abstract socket name").with_source(e))?;
    let listener = UnixListener::bind_addr(&addr)
        .map_err(|e| Error::new(Status::KVSTAGE_E_TRANSPORT, format!("cannot listen on the local socket @{name}")).with_source(e))?;
    listener.set_nonblocking(true)?;
    Ok((name, listener))
}

/// Connects to the abstract socket `name` without ever blocking: a name that does not exist here
/// (another host, another network namespace) or a full backlog fails at once.
pub fn connect_abstract(name: &str, io_timeout: Duration) -> Result<UnixStream> {
    if name.is_empty() || name.len() > 100 || !name.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(Error::new(Status::KVSTAGE_E_PROTOCOL, format!("\"{}\" is not a local socket name", name.escape_debug())));
    }
    // SAFETY: plain socket creation; the fd is owned right below.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK, 0) };
    if fd < 0 {
        return Err(Error::new(Status::KVSTAGE_E_TRANSPORT, "socket(AF_UNIX) failed").with_source(std::io::Error::last_os_error()));
    }
    // SAFETY: `fd` is a fresh socket nobody else owns.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: an all-zero sockaddr_un is valid; the name is copied after the leading NUL.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (dst, src) in addr.sun_path[1..].iter_mut().zip(name.bytes()) {
        *dst = src as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + 1 + name.len();
    // SAFETY: `addr` is a valid sockaddr_un of `len` bytes.
    let rc = unsafe { libc::connect(fd, (&addr as *const libc::sockaddr_un).cast(), len as libc::socklen_t) };
    if rc != 0 {
        return Err(Error::new(Status::KVSTAGE_E_PEER_GONE, format!("cannot reach the local socket @{name}"))
            .with_source(std::io::Error::last_os_error()));
    }
    let stream = UnixStream::from(owned);
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(io_timeout))?;
    stream.set_write_timeout(Some(io_timeout))?;
    Ok(stream)
}

/// Accepts the next connection by `deadline` (the listener is non-blocking).
pub fn accept_by(listener: &UnixListener, deadline: Instant) -> Result<UnixStream> {
    loop {
        match listener.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false)?;
                return Ok(s);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(Error::new(Status::KVSTAGE_E_TIMEOUT, "no connection on the local socket in time"));
                }
                let mut pfd = libc::pollfd { fd: listener.as_raw_fd(), events: libc::POLLIN, revents: 0 };
                // SAFETY: one valid pollfd.
                unsafe { libc::poll(&mut pfd, 1, left.as_millis().clamp(1, 1000) as i32) };
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::new(Status::KVSTAGE_E_TRANSPORT, "accept on the local socket failed").with_source(e)),
        }
    }
}

/// A control buffer for one descriptor, aligned for `cmsghdr` (a `Vec<u8>` only promises bytes).
fn control_buffer() -> (Vec<u64>, usize) {
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<libc::c_int>() as u32) } as usize;
    (vec![0u64; space.div_ceil(8)], space)
}

/// The pid of the process at the other end of `stream` (`SO_PEERCRED`, the kernel's word): for
/// a connecting side, the process that created the listening socket; for an accepted stream,
/// the process that connected.
pub fn peer_pid(stream: &UnixStream) -> Result<i32> {
    // SAFETY: an all-zero ucred is valid; getsockopt writes at most `len` bytes into it.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    let rc = unsafe { libc::getsockopt(stream.as_raw_fd(), libc::SOL_SOCKET, libc::SO_PEERCRED, (&mut cred as *mut libc::ucred).cast(), &mut len) };
    if rc != 0 {
        return Err(Error::new(Status::KVSTAGE_E_TRANSPORT, "SO_PEERCRED on the local socket failed").with_source(std::io::Error::last_os_error()));
    }
    Ok(cred.pid)
}

/// A descriptor that becomes readable when process `pid` ends (`pidfd_open`, Linux 5.3+); `None`
/// where the kernel lacks it or the process is already gone.
pub fn pidfd_open(pid: i32) -> Option<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    // SAFETY: a fresh descriptor we own.
    (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Sends `data` with `fd` attached (`SCM_RIGHTS`).
pub fn send_fd(stream: &UnixStream, fd: BorrowedFd<'_>, data: &[u8]) -> Result<()> {
    let (mut control, space) = control_buffer();
    let mut iov = libc::iovec { iov_base: data.as_ptr() as *mut libc::c_void, iov_len: data.len() };
    // SAFETY: an all-zero msghdr is valid; every pointer set below outlives the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: the control buffer holds one header with room for one int (CMSG_SPACE above).
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<libc::c_int>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<libc::c_int>(), fd.as_raw_fd());
    }
    loop {
        // SAFETY: `msg` is fully initialised above.
        let sent = unsafe { libc::sendmsg(stream.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if sent >= 0 {
            if sent as usize != data.len() {
                // The descriptor went with the first byte; the rest follows as plain data.
                send_all(stream, &data[sent as usize..]).map_err(|e| Error::new(Status::KVSTAGE_E_PEER_GONE, "sending the ring's descriptor failed").with_source(e))?;
            }
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(Error::new(Status::KVSTAGE_E_PEER_GONE, "sending the ring's descriptor failed").with_source(e));
        }
    }
}

/// Writes all of `data` with `MSG_NOSIGNAL`: a peer that closed its end is an `EPIPE` error, never
/// a SIGPIPE, which would kill a C or Python host keeping the default action (`UnixStream::write`
/// raises it on the toolchains kvstage supports).
pub fn send_all(stream: &UnixStream, mut data: &[u8]) -> std::io::Result<()> {
    while !data.is_empty() {
        // SAFETY: sends from a live slice on our socket.
        let sent = unsafe { libc::send(stream.as_raw_fd(), data.as_ptr().cast(), data.len(), libc::MSG_NOSIGNAL) };
        if sent < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        data = &data[sent as usize..];
    }
    Ok(())
}

/// Receives exactly `buf.len()` bytes and the descriptor attached to them, if any. Any further
/// descriptors that fit the control buffer are closed here; the kernel closes those that do not.
pub fn recv_fd(stream: &UnixStream, buf: &mut [u8]) -> Result<Option<OwnedFd>> {
    let (mut control, space) = control_buffer();
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    // SAFETY: an all-zero msghdr is valid; every pointer set below outlives the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    let got = loop {
        // SAFETY: `msg` points at live buffers of the stated sizes.
        let n = unsafe { libc::recvmsg(stream.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n >= 0 {
            break n as usize;
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(Error::new(Status::KVSTAGE_E_PEER_GONE, "receiving the ring's descriptor failed").with_source(e));
        }
    };
    let mut fd = None;
    // SAFETY: the kernel filled `msg`; the macros walk its control buffer within `msg_controllen`.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let n = ((*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / std::mem::size_of::<libc::c_int>();
                for i in 0..n {
                    let raw = std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast::<libc::c_int>().add(i));
                    let owned = OwnedFd::from_raw_fd(raw);
                    if fd.is_none() {
                        fd = Some(owned);
                    }
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    if got == 0 {
        return Err(Error::new(Status::KVSTAGE_E_PEER_GONE, "the peer closed the local socket before sending the ring"));
    }
    (&*stream).read_exact(&mut buf[got..]).map_err(|e| Error::new(Status::KVSTAGE_E_PEER_GONE, "short read on the local socket").with_source(e))?;
    Ok(fd)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn a_descriptor_crosses_an_abstract_socket_with_its_bytes() {
        let (name, listener) = listen_abstract().unwrap();
        let client = connect_abstract(&name, Duration::from_secs(5)).unwrap();
        let server = accept_by(&listener, Instant::now() + Duration::from_secs(5)).unwrap();
        let (a, b) = UnixStream::pair().unwrap();
        send_fd(&client, std::os::fd::AsFd::as_fd(&a), b"hello, ring").unwrap();
        let mut buf = [0u8; 11];
        let fd = recv_fd(&server, &mut buf).unwrap().expect("a descriptor");
        assert_eq!(&buf, b"hello, ring");
        // The received descriptor is the same socket: bytes written through it reach `b`.
        let mut passed = UnixStream::from(fd);
        passed.write_all(b"x").unwrap();
        let mut one = [0u8; 1];
        (&b).read_exact(&mut one).unwrap();
        assert_eq!(&one, b"x");
    }

    #[test]
    fn an_unknown_name_fails_at_once() {
        let e = connect_abstract(&format!("kvstage-shm-none-{}", hex(&random_bytes(8).unwrap())), Duration::from_secs(5)).unwrap_err();
        assert_eq!(e.code(), Status::KVSTAGE_E_PEER_GONE);
        assert!(connect_abstract("bad name\n", Duration::from_secs(1)).is_err());
    }

    #[test]
    fn accept_gives_up_by_its_deadline() {
        let (_name, listener) = listen_abstract().unwrap();
        let e = accept_by(&listener, Instant::now() + Duration::from_millis(50)).unwrap_err();
        assert_eq!(e.code(), Status::KVSTAGE_E_TIMEOUT);
    }
}
