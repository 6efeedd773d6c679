//! The bodies of the daemon's fuzz targets (`fuzz/fuzz_targets/{aidl,config}.rs`, run with
//! cargo-fuzz by `scripts/fuzz.sh`) and of the replay of their stored corpora on the stable
//! toolchain (`daemon/tests/fuzz_replay.rs`, part of `cargo test`).
//!
//! Each body hands its bytes to the entry points the daemon uses on what a client sends or an
//! operator writes, and must return: never panic, hang, or allocate in proportion to a size the
//! input claims rather than holds. Errors are the expected outcome for most inputs.

use crate::config::{Config, Limits};
use crate::error::ServiceError;
use crate::service::context_limit;
use crate::session::{check_count_text, check_request};
use llmd_aidl::ChatMessage::ChatMessage;
use llmd_aidl::GenerateRequest::GenerateRequest;
use llmd_aidl::GenerationStats::GenerationStats;
use llmd_aidl::IGenerationCallback::{BnGenerationCallback, IGenerationCallback};
use llmd_aidl::ILlmAdmin::{BnLlmAdmin, ILlmAdmin};
use llmd_aidl::ILlmService::{BnLlmService, ILlmService};
use llmd_aidl::ILlmSession::{BnLlmSession, ILlmSession};
use llmd_aidl::ModelInfo::ModelInfo;
use llmd_aidl::ServiceStatus::ServiceStatus;
use llmd_aidl::SessionOptions::SessionOptions;
use rsbinder::{BinderResult, Parcel, SIBinder, Strong};
use std::cell::Cell;
use std::path::Path;

/// Target `config`: a config file as `llmd --config` reads it: parsed ([`Config::from_toml`]),
/// validated, and — when valid — everything start-up derives from it: the socket mode, the
/// memory budget in bytes, the scheduler's policy and class caps, the KV type, and the
/// effective configuration printed for the log and `dump`, which must read back as the same
/// configuration.
pub fn config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Ok(config) = Config::from_toml(text, Path::new("llmd.toml")) else { return };
    let _ = config.socket_mode_bits();
    if config.validate().is_err() {
        return;
    }
    let _budget = config.residency.memory_budget_bytes();
    let _policy = config.scheduler.policy(config.prefill_chunk);
    let _caps = [0, 1000, 2000, 10123].map(|uid| config.scheduler.class_cap(uid));
    let _kv = config.kv_cache_type.engine();
    let printed = config.to_toml();
    match Config::from_toml(&printed, Path::new("dump")) {
        Ok(back) => assert_eq!(back, config, "the printed configuration reads back as itself:\n{printed}"),
        Err(e) => panic!("the printed configuration does not read back ({e}):\n{printed}"),
    }
}

/// Target `aidl`: a transaction's data as a client sends it, read by the code rsbinder-aidl
/// generated from `aidl/` (the `on_transact` of each `Bn*` object, the same deserialisation the
/// socket and kernel transports end in), with every argument the daemon reads then checked as
/// the daemon checks it.
///
/// Byte 0 chooses what reads the rest (from byte 2), modulo 8:
/// 0. `ILlmService`, 1. `ILlmSession`, 2. `ILlmAdmin`: a call with transaction code
///    `FIRST_CALL_TRANSACTION + byte 1` (codes past an interface's last method are unknown
///    ones) on an object whose methods run the daemon's checks on their arguments;
/// 3. `IGenerationCallback` (the client's side: `llmctl` and apps read these);
/// 4. a `GenerateRequest`, checked as `ILlmSession.generate` checks it (the generated `generate`
///    stops at the callback binder, which bytes cannot carry);
/// 5. a `SessionOptions`, checked as `openSession` checks it;
/// 6. a `ChatMessage`; 7. the parcelables clients read: `ModelInfo`, `ServiceStatus`,
///    `GenerationStats`.
///
/// Parcels are read in rsbinder's data-only mode: a binder or file descriptor in the bytes is
/// refused (the transports resolve those against their own tables, not from data).
pub fn aidl(data: &[u8]) {
    let (Some(&which), Some(&code)) = (data.first(), data.get(1)) else { return };
    let args = &data[2..];
    let limits = Limits::default();
    match which % 8 {
        object @ 0..=3 => {
            let _ = transact(object, rsbinder::FIRST_CALL_TRANSACTION + u32::from(code), args);
        }
        4 => {
            if let Ok(req) = read_first::<GenerateRequest>(args) {
                let _ = check_request(&req, &limits).map_err(ServiceError::into_status);
            }
        }
        5 => {
            if let Ok(options) = read_first::<SessionOptions>(args) {
                let _ = context_limit(&options, 8192).map_err(ServiceError::into_status);
            }
        }
        6 => {
            let _ = read_first::<ChatMessage>(args);
        }
        _ => {
            let _ = read_first::<ModelInfo>(args);
            let _ = read_first::<ServiceStatus>(args);
            let _ = read_first::<GenerationStats>(args);
        }
    }
}

/// The first value of type `T` in `bytes`, as a method's first argument is read (bytes after
/// it are left, as a transaction's further arguments are).
fn read_first<T: rsbinder::Deserialize>(bytes: &[u8]) -> rsbinder::Result<T> {
    struct First<T>(T);
    impl<T: rsbinder::Deserialize> rsbinder::Deserialize for First<T> {
        fn deserialize(parcel: &mut Parcel) -> rsbinder::Result<Self> {
            let value = parcel.read::<T>()?;
            // Mark the rest read: `from_bytes` refuses bytes left over.
            parcel.set_data_position(parcel.data_size());
            Ok(Self(value))
        }
    }
    rsbinder::from_bytes::<First<T>>(bytes).map(|f| f.0)
}

/// Delivers a transaction with data `args` to object `object` (0 to 3: `ILlmService`,
/// `ILlmSession`, `ILlmAdmin`, `IGenerationCallback`); returns its reply.
fn transact(object: u8, code: u32, args: &[u8]) -> rsbinder::Result<Parcel> {
    CALL.with(|c| c.set(Some((object, code))));
    let reply = rsbinder::from_bytes::<Dispatch>(args).map(|d| d.0);
    CALL.with(|c| c.set(None));
    reply
}

thread_local! {
    /// The object and transaction code [`Dispatch`] delivers the parcel it is read from to.
    static CALL: Cell<Option<(u8, u32)>> = const { Cell::new(None) };
    /// One object of each interface, made once per thread.
    static OBJECTS: [SIBinder; 4] = [
        BnLlmService::new_binder(Service).as_binder(),
        BnLlmSession::new_binder(Session).as_binder(),
        BnLlmAdmin::new_binder(Admin).as_binder(),
        BnGenerationCallback::new_binder(Callback).as_binder(),
    ];
}

/// Read from a data-only parcel by [`rsbinder::from_bytes`]: hands that parcel to the chosen
/// object as the transaction's data, through the dispatch the RPC (socket) server uses once
/// it has checked the interface token.
struct Dispatch(Parcel);

impl rsbinder::Deserialize for Dispatch {
    fn deserialize(parcel: &mut Parcel) -> rsbinder::Result<Self> {
        let Some((object, code)) = CALL.with(Cell::get) else { return Err(rsbinder::StatusCode::BadValue) };
        let mut reply = Parcel::new();
        OBJECTS.with(|o| o[usize::from(object) % 4].rpc_transact(code, parcel, &mut reply))?;
        // The arguments after those the method reads are not the transport's concern.
        parcel.set_data_position(parcel.data_size());
        Ok(Dispatch(reply))
    }
}

/// `ILlmService` with the daemon's argument checks and no model installed.
struct Service;
impl rsbinder::Interface for Service {}
impl ILlmService for Service {
    fn listModels(&self) -> BinderResult<Vec<ModelInfo>> {
        Ok(Vec::new())
    }
    fn getModelInfo(&self, model_id: &str) -> BinderResult<ModelInfo> {
        Err(ServiceError::ModelNotFound(model_id.into()).into_status())
    }
    fn openSession(&self, model_id: &str, options: &SessionOptions) -> BinderResult<Strong<dyn ILlmSession>> {
        context_limit(options, 8192)
            .and_then(|_| Err(ServiceError::ModelNotFound(model_id.into())))
            .map_err(ServiceError::into_status)
    }
    fn getStatus(&self) -> BinderResult<ServiceStatus> {
        Ok(ServiceStatus::default())
    }
}

/// `ILlmSession` with the daemon's request checks (default limits); nothing is queued.
struct Session;
impl rsbinder::Interface for Session {}
impl ILlmSession for Session {
    fn generate(&self, request: &GenerateRequest, _: &Strong<dyn IGenerationCallback>) -> BinderResult<i64> {
        check_request(request, &Limits::default()).map(|_| 1).map_err(ServiceError::into_status)
    }
    fn cancel(&self, _request_id: i64) -> BinderResult<()> {
        Ok(())
    }
    fn countTokens(&self, text: &str) -> BinderResult<i32> {
        check_count_text(text, &Limits::default()).map(|_| 0).map_err(ServiceError::into_status)
    }
    fn reset(&self) -> BinderResult<()> {
        Ok(())
    }
    fn close(&self) -> BinderResult<()> {
        Ok(())
    }
}

/// `ILlmAdmin` with no model installed.
struct Admin;
impl rsbinder::Interface for Admin {}
impl ILlmAdmin for Admin {
    fn prefetch(&self, model_id: &str) -> BinderResult<()> {
        Err(ServiceError::ModelNotFound(model_id.into()).into_status())
    }
    fn dumpState(&self) -> BinderResult<String> {
        Ok(String::new())
    }
}

/// A client's `IGenerationCallback` that takes what it is given.
struct Callback;
impl rsbinder::Interface for Callback {}
impl IGenerationCallback for Callback {
    fn onStarted(&self, _: i64) -> BinderResult<()> {
        Ok(())
    }
    fn onTokens(&self, _: i64, text: &str, ids: &[i32]) -> BinderResult<()> {
        let _ = (text.len(), ids.len());
        Ok(())
    }
    fn onCompleted(&self, _: i64, _: &GenerationStats) -> BinderResult<()> {
        Ok(())
    }
    fn onError(&self, _: i64, _: i32, _: &str) -> BinderResult<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The status a reply starts with: 0 for success, else the exception code.
    fn status(reply: rsbinder::Result<Parcel>) -> i32 {
        let mut reply = reply.expect("the call is delivered");
        reply.set_data_position(0);
        reply.read::<i32>().expect("a status")
    }

    #[test]
    fn calls_reach_the_daemons_checks() {
        let code = |m: u32| rsbinder::FIRST_CALL_TRANSACTION + m;
        let bytes = |v: rsbinder::Result<Vec<u8>>| v.expect("encodes");
        // countTokens: within the limit, then over it (REQUEST_TOO_LARGE, a service-specific error).
        assert_eq!(status(transact(1, code(2), &bytes(rsbinder::to_bytes("hello")))), 0);
        let long = "x".repeat(Limits::default().max_prompt_bytes + 1);
        let service_specific = rsbinder::ExceptionCode::ServiceSpecific as i32;
        assert_eq!(status(transact(1, code(2), &bytes(rsbinder::to_bytes(long.as_str())))), service_specific);
        // openSession: a negative context is refused before the model is looked up.
        let mut args = bytes(rsbinder::to_bytes("m"));
        args.extend(bytes(rsbinder::to_bytes(&SessionOptions { contextTokens: -1 })));
        assert_eq!(status(transact(0, code(2), &args)), service_specific);
        // generate: the callback cannot come from bytes.
        let req = GenerateRequest { prompt: "hi".into(), maxTokens: 4, ..GenerateRequest::default() };
        assert!(transact(1, code(0), &bytes(rsbinder::to_bytes(&req))).is_err());
        // An unknown method.
        assert!(transact(2, code(40), &[]).is_err());
    }
}
