//! Fixed newstyle negotiation: the greeting, the options a client may send before it picks an
//! export (bounded in number and size, with a deadline), TLS when configured, and the export's
//! size and flags.

use std::io::{self, Read, Write};
use std::sync::Arc;

use bulkhead_client::Device;
use bulkhead_nbd::proto::*;

use crate::exports::Exports;
use crate::peer::Peer;
use crate::sockbuf::SockReader;
use crate::tls::{Tls, TlsMode};

/// Largest option payload accepted in negotiation (an export name is at most 4096 bytes).
pub const MAX_OPTION: u32 = 16 << 10;
/// Longest name or query string in an option.
const MAX_STRING: u32 = 4096;
/// Options one connection may send before it must pick an export.
const MAX_OPTIONS: u32 = 64;

/// A protocol error that ends the connection.
pub(crate) fn violation(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

/// What negotiation settled on.
pub(crate) struct Negotiated {
    pub(crate) device: Arc<Device>,
    pub(crate) structured: bool,
}

/// Where option haggling stands.
pub(crate) struct Haggle {
    pub(crate) peer: Peer,
    /// TLS is on.
    pub(crate) tls: bool,
    /// The client asked for no zeroes after `NBD_OPT_EXPORT_NAME`'s reply.
    pub(crate) no_zeroes: bool,
}

/// How option haggling ended.
pub(crate) enum Outcome {
    /// The client aborted.
    Abort,
    /// Transmission on this export.
    Go(Negotiated),
    /// The client asked for TLS and was told yes: the handshake comes next.
    StartTls,
}

/// Sends the server's greeting and reads the client's flags; returns whether the client
/// asked for no zeroes.
pub(crate) fn greet(r: &mut SockReader, w: &mut std::fs::File) -> io::Result<bool> {
    let mut hello = Vec::with_capacity(18);
    hello.extend_from_slice(&NBDMAGIC.to_be_bytes());
    hello.extend_from_slice(&IHAVEOPT.to_be_bytes());
    hello.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    w.write_all(&hello)?;
    let cflags = read_u32(r)?;
    if cflags & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0 {
        return Err(violation(format!("unknown client flags {cflags:#x}")));
    }
    if cflags & FLAG_C_FIXED_NEWSTYLE == 0 {
        return Err(violation("client does not speak fixed newstyle"));
    }
    Ok(cflags & FLAG_C_NO_ZEROES != 0)
}

fn read_u32(r: &mut impl Read) -> io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_be_bytes(b))
}

fn read_u64(r: &mut impl Read) -> io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_be_bytes(b))
}

fn transmission_flags(structured: bool, read_only: bool) -> u16 {
    let mut f =
        TFLAG_HAS_FLAGS | TFLAG_SEND_FLUSH | TFLAG_SEND_FUA | TFLAG_SEND_TRIM | TFLAG_SEND_WRITE_ZEROES | TFLAG_CAN_MULTI_CONN;
    if structured {
        f |= TFLAG_SEND_DF;
    }
    if read_only {
        f |= TFLAG_READ_ONLY;
    }
    f
}

/// Parses the payload of NBD_OPT_INFO / NBD_OPT_GO: name, then the information requested.
fn parse_info_request(data: &[u8]) -> Option<(&[u8], Vec<u16>)> {
    if data.len() < 6 {
        return None;
    }
    let nlen = be32(data) as usize;
    if nlen > MAX_STRING as usize || data.len() < 4 + nlen + 2 {
        return None;
    }
    let name = &data[4..4 + nlen];
    let n = be16(&data[4 + nlen..]) as usize;
    let rest = &data[4 + nlen + 2..];
    if rest.len() != 2 * n {
        return None;
    }
    Some((name, rest.chunks(2).map(be16).collect()))
}

/// Checks the payload of NBD_OPT_LIST_META_CONTEXT / SET_META_CONTEXT.
fn meta_request_valid(data: &[u8]) -> bool {
    if data.len() < 8 {
        return false;
    }
    let nlen = be32(data) as usize;
    if nlen > MAX_STRING as usize || data.len() < 4 + nlen + 4 {
        return false;
    }
    let n = be32(&data[4 + nlen..]) as usize;
    let mut rest = &data[4 + nlen + 4..];
    for _ in 0..n {
        if rest.len() < 4 {
            return false;
        }
        let qlen = be32(rest) as usize;
        if qlen > MAX_STRING as usize || rest.len() < 4 + qlen {
            return false;
        }
        rest = &rest[4 + qlen..];
    }
    rest.is_empty()
}

/// Fixed newstyle negotiation. `None`: the client aborted cleanly.
pub(crate) fn negotiate(
    exports: &Exports,
    tls: Option<&Tls>,
    haggle: &Haggle,
    r: &mut SockReader,
    w: &mut std::fs::File,
) -> io::Result<Outcome> {
    let (peer, no_zeroes) = (haggle.peer, haggle.no_zeroes);
    // TCP clients of an export that requires TLS may do nothing else before it.
    let tls_required = !haggle.tls && matches!(peer, Peer::Tcp(_)) && tls.is_some_and(|t| t.mode == TlsMode::Require);
    let mut structured = false;
    for _ in 0..MAX_OPTIONS {
        let magic = read_u64(r)?;
        if magic != IHAVEOPT {
            return Err(violation(format!("bad option magic {magic:#x}")));
        }
        let opt = read_u32(r)?;
        let len = read_u32(r)?;
        if len > MAX_OPTION {
            // Reading it to stay in step would let a client make us read up to 4 GiB.
            return Err(violation(format!("option {opt} of {len} bytes (limit {MAX_OPTION})")));
        }
        let mut data = vec![0u8; len as usize];
        r.read_exact(&mut data)?;
        let reply = |w: &mut std::fs::File, typ: u32, payload: &[u8]| w.write_all(&option_reply(opt, typ, payload));
        if tls_required && !matches!(opt, OPT_STARTTLS | OPT_ABORT) {
            if opt == OPT_EXPORT_NAME {
                // No error reply exists for this option.
                return Err(violation("NBD_OPT_EXPORT_NAME before TLS, which this server requires"));
            }
            reply(w, REP_ERR_TLS_REQD, b"this server requires TLS")?;
            continue;
        }
        match opt {
            OPT_STARTTLS => {
                if !data.is_empty() || haggle.tls {
                    reply(w, REP_ERR_INVALID, &[])?;
                    continue;
                }
                if tls.is_none() {
                    reply(w, REP_ERR_UNSUP, b"this server has no TLS configured")?;
                    continue;
                }
                reply(w, REP_ACK, &[])?;
                return Ok(Outcome::StartTls);
            }
            OPT_EXPORT_NAME => {
                if data.len() > MAX_STRING as usize {
                    return Err(violation("export name too long"));
                }
                // No error reply exists for this option: an unknown name closes the connection.
                let export = exports.find(&data).ok_or_else(|| violation("unknown export name"))?;
                let device = export.device;
                if !export.reach.allows(peer) {
                    return Err(violation(format!("export {} is not allowed from {peer:?}", device.name())));
                }
                let mut v = Vec::with_capacity(10 + 124);
                v.extend_from_slice(&device.size().to_be_bytes());
                v.extend_from_slice(&transmission_flags(structured, device.read_only()).to_be_bytes());
                if !no_zeroes {
                    v.extend_from_slice(&[0u8; 124]);
                }
                w.write_all(&v)?;
                return Ok(Outcome::Go(Negotiated { device, structured }));
            }
            OPT_ABORT => {
                let _ = reply(w, REP_ACK, &[]);
                return Ok(Outcome::Abort);
            }
            OPT_LIST => {
                if !data.is_empty() {
                    reply(w, REP_ERR_INVALID, &[])?;
                    continue;
                }
                for name in exports.names_for(peer) {
                    let mut p = (name.len() as u32).to_be_bytes().to_vec();
                    p.extend_from_slice(name.as_bytes());
                    reply(w, REP_SERVER, &p)?;
                }
                reply(w, REP_ACK, &[])?;
            }
            OPT_INFO | OPT_GO => {
                let Some((name, infos)) = parse_info_request(&data) else {
                    reply(w, REP_ERR_INVALID, &[])?;
                    continue;
                };
                let Some(export) = exports.find(name) else {
                    reply(w, REP_ERR_UNKNOWN, b"no such export")?;
                    continue;
                };
                let device = export.device;
                if !export.reach.allows(peer) {
                    reply(w, REP_ERR_POLICY, b"this export is not allowed from your address")?;
                    continue;
                }
                let mut export = INFO_EXPORT.to_be_bytes().to_vec();
                export.extend_from_slice(&device.size().to_be_bytes());
                export.extend_from_slice(&transmission_flags(structured, device.read_only()).to_be_bytes());
                reply(w, REP_INFO, &export)?;
                for i in infos {
                    let mut p = i.to_be_bytes().to_vec();
                    match i {
                        INFO_NAME => p.extend_from_slice(device.name().as_bytes()),
                        INFO_DESCRIPTION => p.extend_from_slice(b"bulkhead device"),
                        INFO_BLOCK_SIZE => {
                            let min = device.min_block();
                            p.extend_from_slice(&min.to_be_bytes());
                            p.extend_from_slice(&min.max(4096).to_be_bytes());
                            p.extend_from_slice(&MAX_PAYLOAD.to_be_bytes());
                        }
                        _ => continue, // unknown information: ignored, as the protocol asks
                    }
                    reply(w, REP_INFO, &p)?;
                }
                reply(w, REP_ACK, &[])?;
                if opt == OPT_GO {
                    return Ok(Outcome::Go(Negotiated { device, structured }));
                }
            }
            OPT_STRUCTURED_REPLY => {
                if !data.is_empty() || structured {
                    reply(w, REP_ERR_INVALID, &[])?;
                    continue;
                }
                structured = true;
                reply(w, REP_ACK, &[])?;
            }
            OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => {
                // No metadata context is offered; the reply lists none.
                if !structured || !meta_request_valid(&data) {
                    reply(w, REP_ERR_INVALID, &[])?;
                    continue;
                }
                reply(w, REP_ACK, &[])?;
            }
            // No extended headers, nothing else: refused without changing any state.
            _ => reply(w, REP_ERR_UNSUP, &[])?,
        }
    }
    Err(violation(format!("more than {MAX_OPTIONS} options without choosing an export")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn info_and_meta_payloads_are_parsed_strictly() {
        let mut ok = 4u32.to_be_bytes().to_vec();
        ok.extend_from_slice(b"disk");
        ok.extend_from_slice(&2u16.to_be_bytes());
        ok.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
        ok.extend_from_slice(&INFO_NAME.to_be_bytes());
        let (name, infos) = parse_info_request(&ok).unwrap();
        assert_eq!((name, infos), (&b"disk"[..], vec![INFO_BLOCK_SIZE, INFO_NAME]));
        assert!(parse_info_request(&ok[..ok.len() - 1]).is_none(), "truncated");
        let mut long = ok.clone();
        long.push(0);
        assert!(parse_info_request(&long).is_none(), "trailing byte");
        let mut huge = u32::MAX.to_be_bytes().to_vec();
        huge.extend_from_slice(&[0; 8]);
        assert!(parse_info_request(&huge).is_none(), "name length beyond the payload");

        let mut m = 4u32.to_be_bytes().to_vec();
        m.extend_from_slice(b"disk");
        m.extend_from_slice(&1u32.to_be_bytes());
        m.extend_from_slice(&15u32.to_be_bytes());
        m.extend_from_slice(b"base:allocation");
        assert!(meta_request_valid(&m));
        assert!(!meta_request_valid(&m[..m.len() - 1]));
        let mut lie = m.clone();
        lie[8 + 3] = 9; // claims 9 queries
        assert!(!meta_request_valid(&lie));
    }
}
