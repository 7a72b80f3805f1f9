// Clang thread-safety annotations (-Wthread-safety). They compile to nothing elsewhere.
//
// Put GUARDED_BY(mu_) on every member a mutex guards and REQUIRES(mu_) on every function
// that must be called with it held, so clang checks the locking rules instead of comments.
// Use ckptfs::Mutex / MutexLock (common/mutex.h): std::mutex carries no annotations.
#pragma once

#if defined(__clang__)
#define CKPTFS_TSA(x) __attribute__((x))
#else
#define CKPTFS_TSA(x)
#endif

#define CAPABILITY(x) CKPTFS_TSA(capability(x))
#define SCOPED_CAPABILITY CKPTFS_TSA(scoped_lockable)
#define GUARDED_BY(x) CKPTFS_TSA(guarded_by(x))
#define PT_GUARDED_BY(x) CKPTFS_TSA(pt_guarded_by(x))
#define ACQUIRED_BEFORE(...) CKPTFS_TSA(acquired_before(__VA_ARGS__))
#define ACQUIRED_AFTER(...) CKPTFS_TSA(acquired_after(__VA_ARGS__))
#define REQUIRES(...) CKPTFS_TSA(requires_capability(__VA_ARGS__))
#define REQUIRES_SHARED(...) CKPTFS_TSA(requires_shared_capability(__VA_ARGS__))
#define ACQUIRE(...) CKPTFS_TSA(acquire_capability(__VA_ARGS__))
#define ACQUIRE_SHARED(...) CKPTFS_TSA(acquire_shared_capability(__VA_ARGS__))
#define RELEASE(...) CKPTFS_TSA(release_capability(__VA_ARGS__))
#define RELEASE_SHARED(...) CKPTFS_TSA(release_shared_capability(__VA_ARGS__))
#define RELEASE_GENERIC(...) CKPTFS_TSA(release_generic_capability(__VA_ARGS__))
#define TRY_ACQUIRE(...) CKPTFS_TSA(try_acquire_capability(__VA_ARGS__))
#define EXCLUDES(...) CKPTFS_TSA(locks_excluded(__VA_ARGS__))
#define ASSERT_CAPABILITY(x) CKPTFS_TSA(assert_capability(x))
#define RETURN_CAPABILITY(x) CKPTFS_TSA(lock_returned(x))
#define NO_THREAD_SAFETY_ANALYSIS CKPTFS_TSA(no_thread_safety_analysis)
