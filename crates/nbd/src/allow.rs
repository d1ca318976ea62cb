//! Who may reach an export over TCP: address ranges in CIDR notation (`10.0.0.0/8`,
//! `2001:db8::/32`, or a bare address for one host).

use std::net::IpAddr;

/// One address range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    addr: IpAddr,
    prefix: u8,
}

impl Cidr {
    /// Parses `a.b.c.d/n`, `x::y/n` or a bare address (the whole address).
    pub fn parse(s: &str) -> Result<Cidr, String> {
        let (a, p) = match s.trim().split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (s.trim(), None),
        };
        let addr: IpAddr = a.parse().map_err(|_| format!("`{s}` is not an address or an address/prefix"))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match p {
            None => max,
            Some(p) => p.parse::<u8>().ok().filter(|&n| n <= max).ok_or_else(|| format!("`{s}`: prefix must be 0..={max}"))?,
        };
        Ok(Cidr { addr, prefix })
    }

    /// Whether `ip` lies in the range (an IPv4 address mapped into IPv6 counts as IPv4).
    pub fn contains(&self, ip: IpAddr) -> bool {
        let bits = |ip: IpAddr| -> (u128, u8) {
            match ip.to_canonical() {
                IpAddr::V4(v) => (u128::from(u32::from(v)) << 96, 32),
                IpAddr::V6(v) => (u128::from(v), 128),
            }
        };
        let (want, wlen) = bits(self.addr);
        let (got, glen) = bits(ip);
        if wlen != glen {
            return false;
        }
        let mask = if self.prefix == 0 { 0 } else { u128::MAX << (128 - u32::from(self.prefix)) };
        want & mask == got & mask
    }
}

impl std::fmt::Display for Cidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn ranges_hold_what_their_prefix_says() {
        let net = Cidr::parse("10.1.0.0/16").unwrap();
        assert!(net.contains(ip("10.1.200.3")));
        assert!(!net.contains(ip("10.2.0.1")));
        assert!(net.contains(ip("::ffff:10.1.0.9")), "an IPv4 peer on a dual-stack socket");
        let host = Cidr::parse("127.0.0.1").unwrap();
        assert!(host.contains(ip("127.0.0.1")) && !host.contains(ip("127.0.0.2")));
        let v6 = Cidr::parse("2001:db8::/32").unwrap();
        assert!(v6.contains(ip("2001:db8:ffff::1")) && !v6.contains(ip("2001:db9::1")));
        assert!(!v6.contains(ip("10.1.0.1")));
        assert!(Cidr::parse("0.0.0.0/0").unwrap().contains(ip("192.0.2.1")));
    }

    #[test]
    fn bad_ranges_say_why() {
        assert!(Cidr::parse("10.0.0.0/33").unwrap_err().contains("0..=32"));
        assert!(Cidr::parse("example.com").unwrap_err().contains("not an address"));
        assert!(Cidr::parse("::1/129").unwrap_err().contains("0..=128"));
    }
}
