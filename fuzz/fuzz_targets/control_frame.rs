//! The control socket's framing and calls as `serve` reads them from a client: lines cut at
//! the limit, then each dispatched. Never a panic, and every answer is one line of JSON that
//! is either `ok` or an `error` with a code.
#![no_main]

use bulkhead_control::*;
use libfuzzer_sys::fuzz_target;

/// Answers every call with a fixed, typed reply (what the socket must frame and name).
struct Fixed;

fn refuse<T>(what: &str) -> Result<T, ControlError> {
    Err(ControlError::not_found(format!("no `{what}`")))
}

impl Service for Fixed {
    fn hello(&self, _: Hello) -> Result<HelloReply, ControlError> {
        Ok(HelloReply { protocol: PROTOCOL_VERSION, version: "0".into(), pid: 1, fell_back: None })
    }
    fn status(&self, _: Status) -> Result<StatusReport, ControlError> {
        refuse("status")
    }
    fn restart(&self, c: Restart) -> Result<Changed, ControlError> {
        Ok(Changed { device: c.device, driver_pid: 2 })
    }
    fn set_tap(&self, c: SetTap) -> Result<Changed, ControlError> {
        refuse(&c.device)
    }
    fn activate(&self, c: Activate) -> Result<Activity, ControlError> {
        refuse(&c.device)
    }
    fn deactivate(&self, c: Deactivate) -> Result<Activity, ControlError> {
        refuse(&c.device)
    }
    fn add_filter(&self, c: AddFilter) -> Result<Changed, ControlError> {
        refuse(&c.device)
    }
    fn remove_filter(&self, c: RemoveFilter) -> Result<Changed, ControlError> {
        refuse(&c.device)
    }
    fn snapshot(&self, c: Snapshot) -> Result<Changed, ControlError> {
        refuse(&c.device)
    }
    fn list_snapshots(&self, c: ListSnapshots) -> Result<Snapshots, ControlError> {
        refuse(&c.device)
    }
    fn set_qos(&self, c: SetQos) -> Result<QosReply, ControlError> {
        refuse(&c.view)
    }
    fn add_device(&self, _: AddDevice) -> Result<DevicesAdded, ControlError> {
        Ok(DevicesAdded { devices: Vec::new() })
    }
    fn remove_device(&self, c: RemoveDevice) -> Result<DeviceRemoved, ControlError> {
        Ok(DeviceRemoved { name: c.name, cut_off: Vec::new() })
    }
    fn add_view(&self, c: AddView) -> Result<ViewAdded, ControlError> {
        refuse(&c.device)
    }
    fn remove_view(&self, c: RemoveView) -> Result<ViewRemoved, ControlError> {
        refuse(&c.name)
    }
    fn dump_config(&self, _: DumpConfig) -> Result<ConfigText, ControlError> {
        Ok(ConfigText { toml: String::new() })
    }
    fn reload(&self, _: Reload) -> Result<Reloaded, ControlError> {
        refuse("reload")
    }

    fn upgrade(&self, _: Upgrade) -> Result<Upgrading, ControlError> {
        refuse("upgrade")
    }
}

fuzz_target!(|data: &[u8]| {
    let mut conn = std::io::Cursor::new(data);
    while let Ok(Some(line)) = read_line(&mut conn) {
        let Some(answer) = dispatch(&Fixed, &line) else { continue };
        assert!(!answer.contains('\n'), "an answer is one line: {answer}");
        let v: serde_json::Value = serde_json::from_str(&answer).expect("an answer is JSON");
        let ok = v.get("ok").is_some();
        let code = v.get("error").and_then(|e| e.get("code")).and_then(|c| c.as_str());
        assert!(ok != code.is_some(), "an answer is ok or an error with a code: {answer}");
    }
});
