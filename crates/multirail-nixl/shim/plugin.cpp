// multirail's NIXL backend engine: the C++ side of libplugin_MULTIRAIL.so.
//
// NIXL drives backends through a C++ base class (nixlBackendEngine) that is defined entirely
// in NIXL's headers, which NIXL's wheels do not ship. The declarations below are written from
// NIXL's documented backend interface (docs/BackendGuide.md, src/api/cpp/backend/): the names,
// the order of the virtual methods and the member types are the interface; nothing of NIXL's
// code is copied. The layout was checked against the nixl-cu12 1.5.1 wheel's own plugins:
// vtable _ZTV17nixlBackendEngine of libplugin_POSIX.so has 27 slots in the order declared
// here, ~nixlBackendEngine() touches the members at the offsets asserted below, and
// nixlUcxEngine::postXfer reads the descriptor vector at +0x10 (32-byte elements) and the
// notification flag of the optional arguments at +0x20. docs/nixl-plugin.md.
//
// Rules of this file: every method catches every exception (none may reach NIXL), and all the
// work happens in the Rust runtime behind the mr_nixl_* C functions (crates/multirail-nixl/src).

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace mrnixl {

// ---- NIXL's types, declared from the documented interface ---------------------------------

enum nixl_mem_t { DRAM_SEG, VRAM_SEG, BLK_SEG, OBJ_SEG, FILE_SEG };
enum nixl_xfer_op_t { NIXL_READ, NIXL_WRITE };
enum nixl_status_t {
    NIXL_IN_PROG = 1,
    NIXL_SUCCESS = 0,
    NIXL_ERR_NOT_POSTED = -1,
    NIXL_ERR_INVALID_PARAM = -2,
    NIXL_ERR_BACKEND = -3,
    NIXL_ERR_NOT_FOUND = -4,
    NIXL_ERR_MISMATCH = -5,
    NIXL_ERR_NOT_ALLOWED = -6,
    NIXL_ERR_REPOST_ACTIVE = -7,
    NIXL_ERR_UNKNOWN = -8,
    NIXL_ERR_NOT_SUPPORTED = -9,
    NIXL_ERR_REMOTE_DISCONNECT = -10,
    NIXL_ERR_CANCELED = -11,
    NIXL_ERR_NO_TELEMETRY = -12,
};
enum class nixl_thread_sync_t { NONE, STRICT, RW };
enum class nixl_cost_t { ANALYTICAL_BACKEND = 0 };

using b_params_t = std::unordered_map<std::string, std::string>;
using mem_list_t = std::vector<nixl_mem_t>;
using notif_list_t = std::vector<std::pair<std::string, std::string>>;
using query_resp_t = std::optional<b_params_t>;
using mem_view_t = void *;

struct BasicDesc {
    uintptr_t addr;
    size_t len;
    uint64_t devId;
};

struct BlobDesc : BasicDesc {
    std::string metaInfo;
};

class BackendMD {
protected:
    bool isPrivateMD;

public:
    explicit BackendMD(bool is_private) : isPrivateMD(is_private) {}
    virtual ~BackendMD() {}
};

class BackendReqH {
public:
    BackendReqH() {}
    virtual ~BackendReqH() {}
};

struct MetaDesc : BasicDesc {
    BackendMD *metadataP;
};

struct RemoteMetaDesc : MetaDesc {
    std::string remoteAgent;
};

// A descriptor list as NIXL lays it out: a polymorphic object (vtable pointer), the memory
// type, then the vector of descriptors. The plugin only reads lists NIXL made, so it declares
// the data view and never calls their virtual methods.
template <class T> struct DescListView {
    void *vptr;
    nixl_mem_t type;
    std::vector<T> descs;
};
template <class T> struct DescList; // only ever referenced; read through DescListView
using meta_dlist_t = DescList<MetaDesc>;
using remote_meta_dlist_t = DescList<RemoteMetaDesc>;
using reg_dlist_t = DescList<BlobDesc>;

template <class T> const DescListView<T> &view(const DescList<T> &l) {
    return *reinterpret_cast<const DescListView<T> *>(&l);
}

struct OptArgs {
    std::string notifMsg;
    bool hasNotif = false;
    std::string customParam;
};

struct AgentOptArgs; // the agent's optional arguments (estimateXferCost only; not read)

struct InitParams {
    std::string localAgent;
    std::string type;
    b_params_t *customParams = nullptr;
    bool enableProgTh = false;
    uint64_t pthrDelay = 0;
    nixl_thread_sync_t syncMode;
    bool enableTelemetry_ = false;
};

struct TelemetryEvent {
    uint32_t eventType;
    uint64_t value;
};

// The engine base class: members NIXL reads directly, then the virtual interface in order.
class BackendEngine {
private:
    std::string backendType;
    b_params_t customParams;
    std::vector<TelemetryEvent> telemetryEvents_;
    std::mutex telemetryEventsMutex_;

protected:
    bool initErr = false;
    const std::string localAgent;
    const bool enableTelemetry_;

    nixl_status_t setInitParam(const std::string &key, const std::string &value) {
        return customParams.emplace(key, value).second ? NIXL_SUCCESS : NIXL_ERR_NOT_ALLOWED;
    }

public:
    explicit BackendEngine(const InitParams *p)
        : backendType(p->type), customParams(*p->customParams), localAgent(p->localAgent),
          enableTelemetry_(p->enableTelemetry_) {}
    BackendEngine(const BackendEngine &) = delete;
    void operator=(const BackendEngine &) = delete;

    virtual ~BackendEngine() = default;                                          // slots 0, 1
    virtual bool supportsRemote() const = 0;                                     // 2
    virtual bool supportsLocal() const = 0;                                      // 3
    virtual bool supportsNotif() const = 0;                                      // 4
    virtual mem_list_t getSupportedMems() const = 0;                             // 5
    virtual nixl_status_t registerMem(const BlobDesc &, const nixl_mem_t &, BackendMD *&) = 0; // 6
    virtual nixl_status_t deregisterMem(BackendMD *) = 0;                        // 7
    virtual nixl_status_t connect(const std::string &) = 0;                      // 8
    virtual nixl_status_t disconnect(const std::string &) = 0;                   // 9
    virtual nixl_status_t unloadMD(BackendMD *) = 0;                             // 10
    virtual nixl_status_t prepXfer(const nixl_xfer_op_t &, const meta_dlist_t &, const meta_dlist_t &,
                                   const std::string &, BackendReqH *&, const OptArgs * = nullptr) const = 0; // 11
    virtual nixl_status_t postXfer(const nixl_xfer_op_t &, const meta_dlist_t &, const meta_dlist_t &,
                                   const std::string &, BackendReqH *&, const OptArgs * = nullptr) const = 0; // 12
    virtual nixl_status_t checkXfer(BackendReqH *) const = 0;                    // 13
    virtual nixl_status_t releaseReqH(BackendReqH *) const = 0;                  // 14
    virtual nixl_status_t prepMemView(const remote_meta_dlist_t &, mem_view_t &, const OptArgs * = nullptr) const {
        return NIXL_ERR_NOT_SUPPORTED;                                           // 15
    }
    virtual nixl_status_t prepMemView(const meta_dlist_t &, mem_view_t &, const OptArgs * = nullptr) const {
        return NIXL_ERR_NOT_SUPPORTED;                                           // 16
    }
    virtual void releaseMemView(mem_view_t) const {}                             // 17
    virtual nixl_status_t getPublicData(const BackendMD *, std::string &) const { return NIXL_ERR_BACKEND; } // 18
    virtual nixl_status_t getConnInfo(std::string &) const { return NIXL_ERR_BACKEND; }                      // 19
    virtual nixl_status_t loadRemoteConnInfo(const std::string &, const std::string &) { return NIXL_ERR_BACKEND; } // 20
    virtual nixl_status_t loadRemoteMD(const BlobDesc &, const nixl_mem_t &, const std::string &, BackendMD *&) {
        return NIXL_ERR_BACKEND;                                                 // 21
    }
    virtual nixl_status_t loadLocalMD(BackendMD *, BackendMD *&) { return NIXL_ERR_BACKEND; }               // 22
    virtual nixl_status_t getNotifs(notif_list_t &) { return NIXL_ERR_BACKEND; }                           // 23
    virtual nixl_status_t genNotif(const std::string &, const std::string &) const { return NIXL_ERR_BACKEND; } // 24
    virtual nixl_status_t queryMem(const reg_dlist_t &, std::vector<query_resp_t> &) const {
        return NIXL_ERR_NOT_SUPPORTED;                                           // 25
    }
    virtual nixl_status_t estimateXferCost(const nixl_xfer_op_t &, const meta_dlist_t &, const meta_dlist_t &,
                                           const std::string &, BackendReqH *const &, std::chrono::microseconds &,
                                           std::chrono::microseconds &, nixl_cost_t &,
                                           const AgentOptArgs * = nullptr) const {
        return NIXL_ERR_NOT_SUPPORTED;                                           // 26
    }

    friend struct LayoutCheck;
};

// The layout NIXL 1.5.1 compiled against (from ~nixlBackendEngine in the wheel's plugins).
struct LayoutCheck {
    static_assert(sizeof(std::string) == 32 && sizeof(b_params_t) == 56 && sizeof(std::mutex) == 40,
                  "libstdc++ with the C++11 string ABI on x86_64/aarch64 is required");
    static_assert(offsetof(BackendEngine, backendType) == 0x08);
    static_assert(offsetof(BackendEngine, customParams) == 0x28);
    static_assert(offsetof(BackendEngine, telemetryEvents_) == 0x60);
    static_assert(offsetof(BackendEngine, telemetryEventsMutex_) == 0x78);
    static_assert(offsetof(BackendEngine, initErr) == 0xa0);
    static_assert(offsetof(BackendEngine, localAgent) == 0xa8);
    static_assert(offsetof(BackendEngine, enableTelemetry_) == 0xc8);
    static_assert(sizeof(BackendEngine) == 0xd0);
};
static_assert(sizeof(MetaDesc) == 32 && offsetof(DescListView<MetaDesc>, descs) == 0x10);
static_assert(offsetof(OptArgs, hasNotif) == 0x20);
static_assert(offsetof(InitParams, customParams) == 0x40 && offsetof(InitParams, enableTelemetry_) == 0x5c);

struct Plugin {
    int api_version;
    BackendEngine *(*create_engine)(const InitParams *);
    void (*destroy_engine)(BackendEngine *);
    const char *(*get_plugin_name)();
    const char *(*get_plugin_version)();
    b_params_t (*get_backend_options)();
    mem_list_t (*get_backend_mems)();
};

} // namespace mrnixl

// ---- the Rust runtime's C ABI (crates/multirail-nixl/src/lib.rs) --------------------------

extern "C" {
struct MrEngine;
struct MrXfer;
typedef int (*mr_sink)(void *, const uint8_t *, size_t, const uint8_t *, size_t);
const char *mr_nixl_version();
int mr_nixl_backend_options(mr_sink, void *);
MrEngine *mr_nixl_engine_new(const uint8_t *, size_t, const uint8_t *const *, const size_t *, const uint8_t *const *,
                             const size_t *, size_t, mr_sink, mr_sink, void *);
void mr_nixl_engine_free(MrEngine *);
int mr_nixl_register(const MrEngine *, uint64_t, uint64_t, uint64_t, int, uint64_t *);
int mr_nixl_deregister(const MrEngine *, uint64_t);
int mr_nixl_conn_info(const MrEngine *, mr_sink, void *);
int mr_nixl_public_data(const MrEngine *, uint64_t, mr_sink, void *);
int mr_nixl_load_conn_info(const MrEngine *, const uint8_t *, size_t, const uint8_t *, size_t);
int mr_nixl_load_remote_md(const MrEngine *, const uint8_t *, size_t, const uint8_t *, size_t, uint64_t *);
int mr_nixl_unload_remote_md(const MrEngine *, const uint8_t *, size_t, uint64_t);
int mr_nixl_connect(const MrEngine *, const uint8_t *, size_t);
int mr_nixl_disconnect(const MrEngine *, const uint8_t *, size_t);
int mr_nixl_prep(const MrEngine *, int, int, const void *, size_t, int, const void *, size_t, const uint8_t *, size_t,
                 MrXfer **);
int mr_nixl_post(const MrEngine *, const MrXfer *, int, const uint8_t *, size_t);
int mr_nixl_check(const MrEngine *, const MrXfer *);
int mr_nixl_release(const MrEngine *, MrXfer *);
int mr_nixl_gen_notif(const MrEngine *, const uint8_t *, size_t, const uint8_t *, size_t);
int mr_nixl_get_notifs(const MrEngine *, mr_sink, void *);
}

namespace mrnixl {
namespace {

const uint8_t *u8(const std::string &s) { return reinterpret_cast<const uint8_t *>(s.data()); }

void log_error(const char *where, const char *what) noexcept {
    std::fprintf(stderr, "[multirail-nixl] ERROR: %s: %s\n", where, what);
}

// Sinks: append what Rust hands back into C++ containers. They never throw.
int sink_string(void *ctx, const uint8_t *a, size_t an, const uint8_t *, size_t) noexcept {
    try {
        static_cast<std::string *>(ctx)->append(reinterpret_cast<const char *>(a), an);
        return 0;
    } catch (...) {
        return 1;
    }
}

int sink_pairs(void *ctx, const uint8_t *a, size_t an, const uint8_t *b, size_t bn) noexcept {
    try {
        static_cast<notif_list_t *>(ctx)->emplace_back(std::string(reinterpret_cast<const char *>(a), an),
                                                       std::string(reinterpret_cast<const char *>(b), bn));
        return 0;
    } catch (...) {
        return 1;
    }
}

int sink_map(void *ctx, const uint8_t *a, size_t an, const uint8_t *b, size_t bn) noexcept {
    try {
        static_cast<b_params_t *>(ctx)->emplace(std::string(reinterpret_cast<const char *>(a), an),
                                                std::string(reinterpret_cast<const char *>(b), bn));
        return 0;
    } catch (...) {
        return 1;
    }
}

// What engine creation hands back: the effective settings, or why it failed.
struct Created {
    b_params_t effective;
    std::string error;
};
int sink_effective(void *ctx, const uint8_t *a, size_t an, const uint8_t *b, size_t bn) noexcept {
    return sink_map(&static_cast<Created *>(ctx)->effective, a, an, b, bn);
}
int sink_error(void *ctx, const uint8_t *a, size_t an, const uint8_t *, size_t) noexcept {
    return sink_string(&static_cast<Created *>(ctx)->error, a, an, nullptr, 0);
}

// A registration: a local region of the runtime, a peer's region, or (for local transfers)
// this agent's own region seen as a target.
class MD : public BackendMD {
public:
    enum Kind { Local, Remote, Self } kind;
    uint64_t region;
    std::string agent;
    MD(Kind k, uint64_t r, std::string a) : BackendMD(k != Local), kind(k), region(r), agent(std::move(a)) {}
};

class ReqH : public BackendReqH {
public:
    MrXfer *x = nullptr;
};

template <class F> nixl_status_t guarded(const char *where, F &&f) noexcept {
    try {
        return f();
    } catch (const std::exception &e) {
        log_error(where, e.what());
    } catch (...) {
        log_error(where, "unknown C++ exception");
    }
    return NIXL_ERR_UNKNOWN;
}

class Engine final : public BackendEngine {
    MrEngine *rt = nullptr;

public:
    explicit Engine(const InitParams *p) : BackendEngine(p) {
        try {
            if (p->type != "MULTIRAIL") {
                // The init params struct is not laid out as this plugin expects: a different NIXL.
                log_error("create_engine", "unexpected backend type in the init params (ABI mismatch with this NIXL)");
                initErr = true;
                return;
            }
            std::vector<const uint8_t *> kp, vp;
            std::vector<size_t> kl, vl;
            for (const auto &[k, v] : *p->customParams) {
                kp.push_back(u8(k));
                kl.push_back(k.size());
                vp.push_back(u8(v));
                vl.push_back(v.size());
            }
            Created c;
            rt = mr_nixl_engine_new(u8(localAgent), localAgent.size(), kp.data(), kl.data(), vp.data(), vl.data(),
                                    kp.size(), sink_effective, sink_error, &c);
            if (!rt) {
                log_error("create_backend(MULTIRAIL)", c.error.c_str());
                initErr = true;
                return;
            }
            // The settings in force (given, from MULTIRAIL_* or defaults) show in get_backend_params.
            for (const auto &[k, v] : c.effective)
                (void)setInitParam(k, v);
        } catch (...) {
            log_error("create_engine", "out of memory");
            initErr = true;
        }
    }
    ~Engine() override { mr_nixl_engine_free(rt); }

    bool supportsRemote() const override { return true; }
    bool supportsLocal() const override { return true; }
    bool supportsNotif() const override { return true; }
    mem_list_t getSupportedMems() const override {
        try {
            return {DRAM_SEG, VRAM_SEG};
        } catch (...) {
            return {};
        }
    }

    nixl_status_t registerMem(const BlobDesc &mem, const nixl_mem_t &type, BackendMD *&out) override {
        return guarded("registerMem", [&] {
            if (type != DRAM_SEG && type != VRAM_SEG)
                return NIXL_ERR_NOT_SUPPORTED;
            uint64_t id = 0;
            auto s = nixl_status_t(mr_nixl_register(rt, mem.addr, mem.len, mem.devId, int(type), &id));
            if (s == NIXL_SUCCESS)
                out = new MD(MD::Local, id, std::string());
            return s;
        });
    }
    nixl_status_t deregisterMem(BackendMD *meta) override {
        return guarded("deregisterMem", [&] {
            auto *md = static_cast<MD *>(meta);
            if (!md)
                return NIXL_ERR_INVALID_PARAM;
            auto s = nixl_status_t(mr_nixl_deregister(rt, md->region));
            delete md;
            return s;
        });
    }
    nixl_status_t connect(const std::string &agent) override {
        return guarded("connect", [&] { return nixl_status_t(mr_nixl_connect(rt, u8(agent), agent.size())); });
    }
    nixl_status_t disconnect(const std::string &agent) override {
        return guarded("disconnect", [&] {
            if (agent == localAgent)
                return NIXL_SUCCESS;
            return nixl_status_t(mr_nixl_disconnect(rt, u8(agent), agent.size()));
        });
    }
    nixl_status_t unloadMD(BackendMD *input) override {
        return guarded("unloadMD", [&] {
            auto *md = static_cast<MD *>(input);
            if (md && md->kind == MD::Remote)
                (void)mr_nixl_unload_remote_md(rt, u8(md->agent), md->agent.size(), md->region);
            delete md;
            return NIXL_SUCCESS;
        });
    }

    nixl_status_t prepXfer(const nixl_xfer_op_t &op, const meta_dlist_t &local, const meta_dlist_t &remote,
                           const std::string &agent, BackendReqH *&handle, const OptArgs *) const override {
        return guarded("prepXfer", [&] {
            // The descriptor vectors are read in place (32-byte MetaDesc rows: address, length,
            // device, metadata pointer; asserted above): no copy per descriptor.
            const auto &l = view(local).descs, &r = view(remote).descs;
            auto *h = new ReqH();
            auto s = nixl_status_t(mr_nixl_prep(rt, int(op), int(view(local).type), l.data(), l.size(),
                                                int(view(remote).type), r.data(), r.size(), u8(agent), agent.size(),
                                                &h->x));
            if (s != NIXL_SUCCESS) {
                delete h;
                return s;
            }
            handle = h;
            return NIXL_SUCCESS;
        });
    }
    nixl_status_t postXfer(const nixl_xfer_op_t &, const meta_dlist_t &, const meta_dlist_t &, const std::string &,
                           BackendReqH *&handle, const OptArgs *opt) const override {
        return guarded("postXfer", [&] {
            auto *h = static_cast<ReqH *>(handle);
            if (!h || !h->x)
                return NIXL_ERR_INVALID_PARAM;
            bool has = opt && opt->hasNotif;
            return nixl_status_t(mr_nixl_post(rt, h->x, has ? 1 : 0, has ? u8(opt->notifMsg) : nullptr,
                                              has ? opt->notifMsg.size() : 0));
        });
    }
    nixl_status_t checkXfer(BackendReqH *handle) const override {
        return guarded("checkXfer", [&] {
            auto *h = static_cast<ReqH *>(handle);
            if (!h || !h->x)
                return NIXL_ERR_INVALID_PARAM;
            return nixl_status_t(mr_nixl_check(rt, h->x));
        });
    }
    nixl_status_t releaseReqH(BackendReqH *handle) const override {
        return guarded("releaseReqH", [&] {
            auto *h = static_cast<ReqH *>(handle);
            if (!h)
                return NIXL_SUCCESS;
            // Returns once the transfer no longer touches memory (aborted if still in flight).
            // Freed, so SUCCESS whatever the runtime said: on an error NIXL keeps the handle and
            // releases it again later (a double free).
            auto s = nixl_status_t(mr_nixl_release(rt, h->x));
            delete h;
            if (s != NIXL_SUCCESS)
                log_error("releaseReqH", "the runtime reported an error releasing a transfer (freed anyway)");
            return NIXL_SUCCESS;
        });
    }

    nixl_status_t getPublicData(const BackendMD *meta, std::string &str) const override {
        return guarded("getPublicData", [&] {
            auto *md = static_cast<const MD *>(meta);
            if (!md || md->kind != MD::Local)
                return NIXL_ERR_INVALID_PARAM;
            str.clear();
            return nixl_status_t(mr_nixl_public_data(rt, md->region, sink_string, &str));
        });
    }
    nixl_status_t getConnInfo(std::string &str) const override {
        return guarded("getConnInfo", [&] {
            str.clear();
            return nixl_status_t(mr_nixl_conn_info(rt, sink_string, &str));
        });
    }
    nixl_status_t loadRemoteConnInfo(const std::string &agent, const std::string &info) override {
        return guarded("loadRemoteConnInfo", [&] {
            return nixl_status_t(mr_nixl_load_conn_info(rt, u8(agent), agent.size(), u8(info), info.size()));
        });
    }
    nixl_status_t loadRemoteMD(const BlobDesc &input, const nixl_mem_t &, const std::string &agent,
                               BackendMD *&output) override {
        return guarded("loadRemoteMD", [&] {
            uint64_t id = 0;
            auto s = nixl_status_t(mr_nixl_load_remote_md(rt, u8(agent), agent.size(), u8(input.metaInfo),
                                                          input.metaInfo.size(), &id));
            if (s == NIXL_SUCCESS)
                output = new MD(MD::Remote, id, agent);
            return s;
        });
    }
    nixl_status_t loadLocalMD(BackendMD *input, BackendMD *&output) override {
        return guarded("loadLocalMD", [&] {
            auto *md = static_cast<MD *>(input);
            if (!md)
                return NIXL_ERR_INVALID_PARAM;
            output = new MD(MD::Self, md->region, localAgent);
            return NIXL_SUCCESS;
        });
    }
    nixl_status_t getNotifs(notif_list_t &list) override {
        return guarded("getNotifs", [&] { return nixl_status_t(mr_nixl_get_notifs(rt, sink_pairs, &list)); });
    }
    nixl_status_t genNotif(const std::string &agent, const std::string &msg) const override {
        return guarded("genNotif", [&] {
            return nixl_status_t(mr_nixl_gen_notif(rt, u8(agent), agent.size(), u8(msg), msg.size()));
        });
    }
};

BackendEngine *create_engine(const InitParams *p) noexcept {
    try {
        return new Engine(p);
    } catch (...) {
        log_error("create_engine", "out of memory");
        return nullptr;
    }
}

void destroy_engine(BackendEngine *e) noexcept {
    try {
        delete e;
    } catch (...) {
    }
}

const char *plugin_name() noexcept { return "MULTIRAIL"; }
const char *plugin_version() noexcept { return mr_nixl_version(); }

b_params_t backend_options() noexcept {
    try {
        b_params_t m;
        (void)mr_nixl_backend_options(sink_map, &m);
        return m;
    } catch (...) {
        return {};
    }
}

mem_list_t backend_mems() noexcept {
    try {
        return {DRAM_SEG, VRAM_SEG};
    } catch (...) {
        return {};
    }
}

Plugin plugin = {1, create_engine, destroy_engine, plugin_name, plugin_version, backend_options, backend_mems};

} // namespace
} // namespace mrnixl

// Called by nixl_plugin_init/fini in src/lib.rs (which the cdylib exports).
extern "C" void *mr_nixl_shim_init() { return &mrnixl::plugin; }
extern "C" void mr_nixl_shim_fini() {}
