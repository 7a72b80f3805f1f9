# Installation layout and the Debian package (CPack). scripts/package.sh builds it:
#   cmake -DCMAKE_INSTALL_PREFIX=/usr ... && cmake --build ... && cpack -G DEB
#
# Installed: the two programs, the mount helpers mount.fuse.ckptfs and mount.ckptfs
# (symlinks to ckptfs, which acts as a mount(8) helper when called by those names), the
# systemd unit ckptfs@.service, man pages generated from --help (help2man), the docs,
# and the contrib/ examples (Slurm, Kubernetes, Grafana, logrotate).
include(GNUInstallDirs)

set(CKPTFS_SYSTEMD_UNIT_DIR "lib/systemd/system" CACHE STRING
    "Where ckptfs@.service goes, relative to the install prefix")

# mount(8) runs /sbin/mount.<type>; Debian 12 has a merged /usr, so /usr/sbin is /sbin.
if(TARGET ckptfs)
  foreach(helper mount.fuse.ckptfs mount.ckptfs)
    install(CODE "
      file(MAKE_DIRECTORY \"\$ENV{DESTDIR}\${CMAKE_INSTALL_PREFIX}/${CMAKE_INSTALL_SBINDIR}\")
      file(CREATE_LINK ../${CMAKE_INSTALL_BINDIR}/ckptfs
           \"\$ENV{DESTDIR}\${CMAKE_INSTALL_PREFIX}/${CMAKE_INSTALL_SBINDIR}/${helper}\" SYMBOLIC)")
  endforeach()
endif()

install(FILES ${CMAKE_SOURCE_DIR}/contrib/systemd/ckptfs@.service
        DESTINATION ${CKPTFS_SYSTEMD_UNIT_DIR})
# Lets a pipe hold a whole FUSE request, so write payloads are spliced (fs/transport/fuse_ops.cc, OpInit).
install(FILES ${CMAKE_SOURCE_DIR}/contrib/sysctl/90-ckptfs.conf DESTINATION lib/sysctl.d)
install(FILES ${CMAKE_SOURCE_DIR}/contrib/systemd/ckptfs.conf.example
              ${CMAKE_SOURCE_DIR}/contrib/prometheus-alerts.yaml
        DESTINATION ${CMAKE_INSTALL_DOCDIR}/examples)
install(FILES ${CMAKE_SOURCE_DIR}/contrib/logrotate/ckptfs
        DESTINATION ${CMAKE_INSTALL_DOCDIR}/examples/logrotate)
install(DIRECTORY ${CMAKE_SOURCE_DIR}/contrib/slurm ${CMAKE_SOURCE_DIR}/contrib/kubernetes
                  ${CMAKE_SOURCE_DIR}/contrib/grafana
        DESTINATION ${CMAKE_INSTALL_DOCDIR}/examples USE_SOURCE_PERMISSIONS)
install(FILES ${CMAKE_SOURCE_DIR}/README.md ${CMAKE_SOURCE_DIR}/docs/SEMANTICS.md
              ${CMAKE_SOURCE_DIR}/docs/integration.md
        DESTINATION ${CMAKE_INSTALL_DOCDIR})

# Man pages from --help and --version, so they never drift from the programs.
find_program(HELP2MAN help2man)
if(HELP2MAN AND TARGET ckptfs AND TARGET ckptfs-admin)
  set(man_dir ${CMAKE_BINARY_DIR}/man)
  add_custom_command(
    OUTPUT ${man_dir}/ckptfs.8.gz
    COMMAND ${CMAKE_COMMAND} -E make_directory ${man_dir}
    COMMAND ${HELP2MAN} --no-info --no-discard-stderr --section 8
            --name "FUSE file system for fast, safe training checkpoints"
            --include ${CMAKE_SOURCE_DIR}/cmake/ckptfs.h2m
            --output ${man_dir}/ckptfs.8 $<TARGET_FILE:ckptfs>
    COMMAND gzip -9nf ${man_dir}/ckptfs.8
    DEPENDS ckptfs ${CMAKE_SOURCE_DIR}/cmake/ckptfs.h2m VERBATIM)
  add_custom_command(
    OUTPUT ${man_dir}/ckptfs-admin.1.gz
    COMMAND ${CMAKE_COMMAND} -E make_directory ${man_dir}
    COMMAND ${HELP2MAN} --no-info --no-discard-stderr --section 1
            --name "inspect and control a running ckptfs mount"
            --output ${man_dir}/ckptfs-admin.1 $<TARGET_FILE:ckptfs-admin>
    COMMAND gzip -9nf ${man_dir}/ckptfs-admin.1
    DEPENDS ckptfs-admin VERBATIM)
  add_custom_target(ckptfs_man ALL DEPENDS ${man_dir}/ckptfs.8.gz ${man_dir}/ckptfs-admin.1.gz)
  install(FILES ${man_dir}/ckptfs.8.gz DESTINATION ${CMAKE_INSTALL_MANDIR}/man8)
  install(FILES ${man_dir}/ckptfs-admin.1.gz DESTINATION ${CMAKE_INSTALL_MANDIR}/man1)
else()
  message(STATUS "ckptfs: help2man not found; no man pages")
endif()

set(CPACK_GENERATOR "DEB")
set(CPACK_PACKAGE_NAME "ckptfs")
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_CONTACT "ckptfs maintainers <ckptfs@localhost>")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY ${PROJECT_DESCRIPTION})
set(CPACK_PACKAGE_DESCRIPTION
    "ckptfs is mounted once per node under unmodified checkpoint code (PyTorch DCP,\
 Megatron-LM dist_checkpointing). It stages writes in memory, publishes them to a\
 shared backing directory in order, commits a DCP checkpoint only when all its shards\
 are durable, and deduplicates reads across ranks and nodes.")
set(CPACK_DEBIAN_PACKAGE_SECTION "admin")
set(CPACK_DEBIAN_PACKAGE_HOMEPAGE ${PROJECT_HOMEPAGE_URL})
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
# Shared-library dependencies come from dpkg-shlibdeps; fuse3 gives fusermount3, which
# unmounting needs.
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
set(CPACK_DEBIAN_PACKAGE_DEPENDS "fuse3")
set(CPACK_DEBIAN_PACKAGE_SUGGESTS "python3-torch")
set(CPACK_STRIP_FILES ON)
set(CPACK_PACKAGING_INSTALL_PREFIX "/usr")
set(CPACK_DEBIAN_PACKAGE_CONTROL_STRICT_PERMISSION ON)
include(CPack)
