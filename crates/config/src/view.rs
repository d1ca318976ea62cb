//! `[[device.view]]`: a part of a device exported under a name of its own (Xen's virtual block
//! devices), over channels of its own, with its QoS.

use serde::Deserialize;
use toml::Spanned;

use crate::{ConfigError, Size};

/// One `[[device.view]]` table.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct View {
    /// Name: its FUSE file and NBD export name (one namespace with the devices).
    pub name: Spanned<String>,
    /// Where it starts in the device, bytes (a multiple of 512; default 0).
    pub offset: Option<Spanned<Size>>,
    /// Its size, bytes (a multiple of 512; default: the rest of the device).
    pub size: Option<Spanned<Size>>,
    /// Refuse writes, discards and write-zeroes.
    #[serde(default)]
    pub read_only: bool,
    /// Channel queues of its own (default 1).
    pub queues: Option<Spanned<u32>>,
    /// Credits: bytes granted every `credit_us`.
    pub credit_bytes: Option<Spanned<Size>>,
    /// The credit period, µs (default 1000).
    pub credit_us: Option<Spanned<u64>>,
    /// Most byte credit saved up (default one period's).
    pub burst_bytes: Option<Spanned<Size>>,
    /// Requests per second.
    pub iops: Option<Spanned<u64>>,
    /// Most request credit saved up (default a tenth of a second's).
    pub burst_ios: Option<Spanned<u64>>,
    /// Share among uncapped views (1..=1000, default 1).
    pub weight: Option<Spanned<u32>>,
    /// Address ranges TCP clients of its NBD export may come from (default: any).
    pub nbd_allow: Option<Spanned<Vec<String>>>,
    /// Queues applications may attach to the view (default [`crate::DEFAULT_ATTACH`]; 0: none).
    pub attach: Option<Spanned<u32>>,
}

/// Views one device may have.
pub const MAX_VIEWS: usize = bulkhead_qos::page::MAX_VIEWS;

impl View {
    /// The keys of a view that may change on a running `serve` (`bulkhead reload`, `bulkhead
    /// qos`): its QoS. A change to any other key is refused, naming it.
    pub const LIVE: [&'static str; 6] = bulkhead_qos::KEYS;

    /// Its queue count.
    pub fn queue_count(&self) -> u32 {
        self.queues.as_ref().map_or(1, |q| *q.get_ref())
    }

    /// Queues applications may attach to it.
    pub fn attach_slots(&self) -> u32 {
        self.attach.as_ref().map_or(crate::DEFAULT_ATTACH, |a| *a.get_ref())
    }

    /// Its offset in the device.
    pub fn offset(&self) -> u64 {
        self.offset.as_ref().map_or(0, |o| o.get_ref().0)
    }

    /// Its size within a device of `device_size` bytes.
    pub fn size_in(&self, device_size: u64) -> u64 {
        self.size.as_ref().map_or(device_size.saturating_sub(self.offset()), |s| s.get_ref().0)
    }

    /// Its QoS.
    pub fn caps(&self) -> bulkhead_qos::Caps {
        let d = bulkhead_qos::Caps::default();
        bulkhead_qos::Caps {
            credit_bytes: self.credit_bytes.as_ref().map_or(0, |v| v.get_ref().0),
            credit_us: self.credit_us.as_ref().map_or(d.credit_us, |v| *v.get_ref()),
            burst_bytes: self.burst_bytes.as_ref().map_or(0, |v| v.get_ref().0),
            iops: self.iops.as_ref().map_or(0, |v| *v.get_ref()),
            burst_ios: self.burst_ios.as_ref().map_or(0, |v| *v.get_ref()),
            weight: self.weight.as_ref().map_or(d.weight, |v| *v.get_ref()),
        }
        .with_default_bursts()
    }

    /// Checks the view against its device (`device_size` when the configuration gives it);
    /// errors name the device, the view, the key and (through `err`) the line.
    pub(crate) fn check(
        &self,
        device: &str,
        device_size: Option<u64>,
        err: &impl Fn(std::ops::Range<usize>, String) -> ConfigError,
    ) -> Result<(), ConfigError> {
        let name = self.name.get_ref();
        let at = |key: &str, m: String| format!("device `{device}`: view `{name}`: key `{key}`: {m}");
        if let Some(o) = &self.offset {
            if o.get_ref().0 % 512 != 0 {
                return Err(err(o.span(), at("offset", format!("{} is not a multiple of 512", o.get_ref().0))));
            }
        }
        if let Some(s) = &self.size {
            if s.get_ref().0 == 0 || s.get_ref().0 % 512 != 0 {
                return Err(err(s.span(), at("size", format!("{} is not a positive multiple of 512", s.get_ref().0))));
            }
        }
        crate::check_attach(&self.attach, &format!("device `{device}`: view `{name}`"), err)?;
        if let Some(q) = &self.queues {
            if !(1..=64).contains(q.get_ref()) {
                return Err(err(q.span(), at("queues", format!("{} is out of range 1..=64", q.get_ref()))));
            }
        }
        if let Some(total) = device_size {
            let end = self.offset().checked_add(self.size_in(total));
            if end.is_none_or(|e| e > total) || self.offset() >= total {
                let span = self.size.as_ref().map(|s| s.span()).or(self.offset.as_ref().map(|o| o.span()));
                return Err(err(
                    span.unwrap_or(self.name.span()),
                    at(
                        if self.size.is_some() { "size" } else { "offset" },
                        format!(
                            "{} bytes at offset {} reach past the device's end ({total} bytes)",
                            self.size_in(total),
                            self.offset()
                        ),
                    ),
                ));
            }
        }
        crate::check_allow(&self.nbd_allow, &format!("device `{device}`: view `{name}`"), err)?;
        let caps = self.caps();
        if let Err(m) = caps.check() {
            // The message names the key; point at its line.
            let span = [
                ("`credit_us`", self.credit_us.as_ref().map(|v| v.span())),
                ("`burst_bytes`", self.burst_bytes.as_ref().map(|v| v.span())),
                ("`burst_ios`", self.burst_ios.as_ref().map(|v| v.span())),
                ("`weight`", self.weight.as_ref().map(|v| v.span())),
            ]
            .into_iter()
            .find_map(|(k, s)| if m.contains(k) { s } else { None })
            .unwrap_or(self.name.span());
            return Err(err(span, format!("device `{device}`: view `{name}`: {m}")));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::{Config, ConfigError};

    fn parse(views: &str) -> Result<Config, ConfigError> {
        let src = format!("[[device]]\nname = \"disk0\"\nsize = \"1G\"\n[device.backend]\ntype = \"ram\"\n{views}");
        Config::parse(&src, "test.toml")
    }

    fn error(views: &str) -> String {
        parse(views).unwrap_err().to_string()
    }

    #[test]
    fn views_parse_with_their_qos() {
        let c = parse(
            "[[device.view]]\nname = \"vm1\"\nsize = \"256M\"\ncredit_bytes = \"512K\"\ncredit_us = 10000\n\
             [[device.view]]\nname = \"vm2\"\noffset = \"256M\"\nread_only = true\nweight = 4\nqueues = 2\n",
        )
        .unwrap();
        let v = &c.devices[0].views;
        assert_eq!(v.len(), 2);
        assert_eq!((v[0].offset(), v[0].size_in(1 << 30)), (0, 256 << 20));
        let caps = v[0].caps();
        assert_eq!((caps.credit_bytes, caps.credit_us, caps.burst_bytes), (512 << 10, 10_000, 512 << 10));
        assert_eq!((v[1].offset(), v[1].size_in(1 << 30), v[1].read_only), (256 << 20, 768 << 20, true));
        assert_eq!((v[1].caps().weight, v[1].queue_count()), (4, 2));
    }

    #[test]
    fn bad_views_name_device_view_key_and_line() {
        let e = error("[[device.view]]\nname = \"vm1\"\noffset = \"768M\"\nsize = \"512M\"\n");
        assert!(e.contains("line 9") && e.contains("view `vm1`: key `size`") && e.contains("past the device's end"), "{e}");
        let e = error("[[device.view]]\nname = \"vm1\"\noffset = 1000\n");
        assert!(e.contains("line 8") && e.contains("key `offset`: 1000 is not a multiple of 512"), "{e}");
        let e = error("[[device.view]]\nname = \"vm1\"\niops = 100\nweight = 2\n");
        assert!(e.contains("line 9") && e.contains("key `weight`"), "{e}");
        let e = error("[[device.view]]\nname = \"disk0\"\n");
        assert!(e.contains("line 7") && e.contains("`disk0` is defined twice"), "{e}");
        let e = error("[[device.view]]\nname = \"a b\"\n");
        assert!(e.contains("not a valid view name"), "{e}");
        let e = error("[[device.view]]\nname = \"vm1\"\nspeed = 3\n");
        assert!(e.contains("speed"), "{e}");
        let e = error("[[device.view]]\nname = \"vm1\"\nnbd_allow = [\"10.0.0.0/8\", \"10.0.0.0/40\"]\n");
        assert!(e.contains("line 8") && e.contains("key `nbd_allow`") && e.contains("0..=32"), "{e}");
        let e = error("[[device.view]]\nname = \"vm1\"\nattach = 65\n");
        assert!(e.contains("line 8") && e.contains("view `vm1`: key `attach`: 65 is more than 64"), "{e}");
    }

    #[test]
    fn attach_slots_default_to_four_and_may_be_none() {
        let src = "[[device]]\nname = \"disk0\"\nsize = \"1G\"\nattach = 0\n[device.backend]\ntype = \"ram\"\n\
                   [[device.view]]\nname = \"vm1\"\n[[device.view]]\nname = \"vm2\"\nattach = 2\n";
        let c = Config::parse(src, "test.toml").unwrap();
        let d = &c.devices[0];
        assert_eq!((d.attach_slots(), d.views[0].attach_slots(), d.views[1].attach_slots()), (0, 4, 2));
    }
}
